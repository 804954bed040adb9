"""fabric.integrations for OpenRLHF (0.11.2; see docs/integrations.md): ``reward_func`` as
the single-turn executor calls it, and the HTTP reward server over a socket (large batches,
clients that hang up, draining on close, ``fabric openrlhf-serve`` until interrupted)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
from pathlib import Path

import integ_fns
import pytest
from integ_fns import REG
from integ_helpers import LOCAL1, fake_backend

from fabric.integrations import BadBatchError, IntegrationConfig, RewardCallError
from fabric.integrations.openrlhf import OpenRLHFReward, RewardServer
from fabric.registry import Registry

# integ_helpers: a FakeBackend over integ_fns.REG
fake = pytest.fixture(fake_backend, name="fake")


# ----------------------------------------------------------------------------- OpenRLHF

PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_openrlhf_reward_func_as_the_single_turn_executor_calls_it():
    with OpenRLHFReward("math_answer", registry=Registry(), backend=LOCAL1) as reward_func:
        # one sample per call, lists; the query is the decoded prompt + response, special tokens kept
        out = reward_func([PROMPT + "2+3 = 5, so the answer is 5.<|im_end|>"], [PROMPT], ["5"])
        assert out == {
            "rewards": [1.0],
            "scores": [1.0],
            "extra_logs": {"correct": [1.0], "extracted": [1.0]},
        }
        assert reward_func.response(PROMPT + "x<|endoftext|>", PROMPT) == "x"
        with pytest.raises(BadBatchError, match="2 queries, 1 prompts and 1 labels"):
            reward_func(["a", "b"], [PROMPT], ["5"])


def test_openrlhf_a_left_truncated_prompt_is_not_scored_as_the_response(fake):
    # OpenRLHF keeps a long prompt's last tokens: the query no longer holds the whole prompt,
    # and the whole query (a few-shot answer included) was scored as the response
    prompt = (
        "<|im_start|>user\nExample: 3+4? Answer: 7\n" + "filler " * 50 + "\nNow: 2+5?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    response = "I don't know.<|im_end|>"
    with OpenRLHFReward("contains", registry=REG, backend_instance=fake, args={"answer": "label"}) as r:
        for cut in (20, 45, 200, len(prompt) - 30, len(prompt) - 3):  # in the filler too; a short end
            assert r.response(prompt[cut:] + response, prompt) == "I don't know.", cut
        assert r([prompt[20:] + response], [prompt], ["7"])["rewards"] == [0.0]
        assert r([prompt + "7<|im_end|>"], [prompt], ["7"])["rewards"] == [1.0]
        # nothing of the prompt in the query: all of it is the response, as before
        assert r.response("7 it is", prompt) == "7 it is"
        long = "ab" * 50_000  # repetitive: every offset is a candidate
        assert r.response(long[1001:] + "zz", long) == "zz"


def test_openrlhf_json_labels_and_failures(fake):
    label = json.dumps({"tests": ["a", "c"], "difficulty": 3})
    with OpenRLHFReward("with_tests", registry=REG, backend_instance=fake) as reward_func:
        out = reward_func(["p: a b c"], ["p:"], [label])
        assert out["rewards"] == [1.0] and out["extra_logs"] == {"passed": [2.0]}
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake) as reward_func:
        with pytest.raises(RewardCallError, match="UserError"):
            reward_func(["p boom"], ["p"], ["g"])  # ground_truth <- label
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake, failure_score=-0.5) as reward_func:
        out = reward_func(["p boom", "p ok"], ["p", "p"], ["g", "g"])
        assert out["rewards"] == [-0.5, 1.0] and out["extra_logs"] == {"fabric_failed": [1.0, 0.0]}


async def test_openrlhf_http_form_over_a_socket():
    import aiohttp

    cfg = IntegrationConfig(function="explode", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG, max_body_bytes=64 * 1024) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/get_reward")
        async with aiohttp.ClientSession() as http:
            # what OpenRLHF's _fetch_rewards_via_http posts
            body = {"query": ["p fine", "p also fine"], "prompts": ["p", "p"], "labels": ["g", "g"]}
            async with http.post(server.url, json=body) as resp:
                assert resp.status == 200
                assert await resp.json() == {"rewards": [1.0, 1.0], "scores": [1.0, 1.0], "extra_logs": {}}
            async with http.post(server.url, json={**body, "query": ["p boom", "p"]}) as resp:
                assert resp.status == 502  # OpenRLHF retries, then leaves the sample unrewarded
                data = await resp.json()
                assert data["failures"][0]["index"] == 0 and data["failures"][0]["type"] == "UserError"
            async with http.post(server.url, json={**body, "labels": ["g"]}) as resp:
                assert (
                    resp.status == 400 and "2 queries, 2 prompts and 1 labels" in (await resp.json())["error"]
                )
            async with http.post(server.url, data=b"[1, 2") as resp:
                assert resp.status == 400
            async with http.post(server.url, json={**body, "query": ["x" * 100_000, "y"]}) as resp:
                assert resp.status == 413
            async with http.get(server.url.replace("/get_reward", "/healthz")) as resp:
                assert (await resp.json())["function"] == "explode"


async def test_openrlhf_http_a_missing_field_is_named_not_called_a_wrong_type():
    # a body without "labels" gave each sample a null label, which the function refused, and
    # the 400 asked "a column of the wrong type?" of a column that was not there at all
    import aiohttp

    cfg = IntegrationConfig(function="explode", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:

        async def error(body: dict[str, object]) -> str:
            async with http.post(server.url, json=body) as resp:
                assert resp.status == 400
                return str((await resp.json())["error"])

        missing = await error({"query": ["p a"], "prompts": ["p"]})
        assert 'no "labels"' in missing and "wrong type" not in missing
        assert '"query", "prompts", "labels"' in missing  # the fields expected
        assert "ground_truth" in missing  # what needed it
        missing = await error({"prompts": ["p"], "labels": ["g"]})
        assert 'no "query"' in missing and '"query", "prompts", "labels"' in missing
        # present but of the wrong type: the message says so, as before
        wrong = await error({"query": ["p a"], "prompts": ["p"], "labels": [3]})
        assert "a column of the wrong type?" in wrong and "no " not in wrong.split(";")[0]
        # a function that needs no label is scored without one, as before
    cfg = IntegrationConfig(function="length", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        async with http.post(server.url, json={"query": ["p abc"], "prompts": ["p"]}) as resp:
            assert resp.status == 200 and (await resp.json())["rewards"] == [4.0]
    # nor does one whose ground_truth (<- label) is optional: it keeps its default; the null
    # labels standing in were sent, and refused as a missing field the function needs
    cfg = IntegrationConfig(function="graded_if_given", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        async with http.post(server.url, json={"query": ["p abc"], "prompts": ["p"]}) as resp:
            assert resp.status == 200 and (await resp.json())["rewards"] == [1.0]


async def test_openrlhf_http_an_absent_prompts_field_is_not_blamed_for_a_refused_label():
    # "prompts" absent stands in as empty strings, which a str parameter takes: a label of the
    # wrong type beside it was answered 'the body has no "prompts" field ... and explode needs
    # it', sending the user to add prompts the function never asked for
    import aiohttp

    cfg = IntegrationConfig(function="explode", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        async with http.post(server.url, json={"query": ["p a"], "labels": [3]}) as resp:
            assert resp.status == 400
            text = str((await resp.json())["error"])
    assert '"prompts"' not in text and "a column of the wrong type?" in text, text


def test_a_refusal_of_the_arguments_pickles_back_whole():
    # veRL's remote reward manager calls the function in a Ray actor, which pickles what it
    # raises back to the trainer: BadBatchError did, but its RefusedArgumentsError took four
    # arguments to rebuild and pickle gave it one (a TypeError in place of the refusal)
    import pickle

    from fabric.integrations import RefusedArgumentsError
    from fabric.protocol import ErrorInfo

    e = RefusedArgumentsError(
        "f(traj, ground_truth)", 2, 3, (1, ErrorInfo(type="InvalidArguments", message="no"))
    )
    copy = pickle.loads(pickle.dumps(e))
    assert isinstance(copy, RefusedArgumentsError) and str(copy) == str(e)
    assert (copy.signature, copy.count, copy.total, copy.first_refusal) == (
        "f(traj, ground_truth)",
        2,
        3,
        e.first_refusal,
    )


async def test_openrlhf_http_a_micro_batch_over_6_mib_is_scored_not_413():
    # older OpenRLHF posts a whole micro-batch to one server: 100 samples of 70 KB are 7 MB
    # together, each far under the 6 MiB call limit, and were refused whole with 413
    import aiohttp

    cfg = IntegrationConfig(function="length", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        n, size = 100, 70_000
        body = {"query": ["p" + "x" * size] * n, "prompts": ["p"] * n, "labels": [""] * n}
        async with http.post(server.url, json=body) as resp:
            assert resp.status == 200 and (await resp.json())["rewards"] == [float(size)] * n
        # the per-call limit still holds for one sample: it fails (502: no failure_score)
        body = {"query": ["p" + "x" * (7 * 1024 * 1024), "p"], "prompts": ["p", "p"], "labels": ["", ""]}
        async with http.post(server.url, json=body) as resp:
            assert resp.status == 502
            assert [f["type"] for f in (await resp.json())["failures"]] == ["PayloadTooLarge"]


async def test_openrlhf_http_a_request_whose_client_hung_up_is_cancelled():
    # OpenRLHF gives up on a request after 180 s and posts it again, 5 times: the calls of a
    # request nobody waits for any more ran on, one more copy in the pool at each retry
    import aiohttp

    cfg = IntegrationConfig(function="waits", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server:
        async with aiohttp.ClientSession() as http:
            body = {"query": ["q"], "prompts": [""], "labels": ["hung-up"]}
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(server.url, json=body, timeout=aiohttp.ClientTimeout(total=0.5)):
                    pass  # never reached: the client gives up on the hung reward first
        for _ in range(400):  # the function would finish at 5 s; wait up to 20
            if "hung-up" in integ_fns.OUTCOMES:
                break
            await asyncio.sleep(0.05)
        assert integ_fns.OUTCOMES.get("hung-up") == "cancelled"
    # and the command's deadline comes before OpenRLHF's 180 s (aiohttp ClientTimeout(total=180))
    from fabric.cli import openrlhf_serve

    assert inspect.signature(openrlhf_serve).parameters["deadline_s"].default < 180


async def test_openrlhf_http_close_drains_then_a_second_signal_cancels():
    """Ctrl-C waited silently for aiohttp's 60 s shutdown timeout; a second one did nothing."""
    import aiohttp

    from fabric.serve.drain import close_in_two_steps

    async def until_in_flight(server: RewardServer) -> None:
        for _ in range(3000):
            if server.requests:
                return
            await asyncio.sleep(0.01)
        pytest.fail("the request never reached the server")

    def body(label: str) -> dict:
        return {"query": ["q"], "prompts": [""], "labels": [label]}

    quick = IntegrationConfig(function="waits", backend="inproc", builtins=False, constants={"delay_s": 0.5})
    server = RewardServer(quick, port=0, registry=REG, drain_s=60)
    await server.start()
    async with aiohttp.ClientSession() as http:
        finishing = asyncio.create_task(http.post(server.url, json=body("drained")))
        await until_in_flight(server)
        await close_in_two_steps(server.aclose(), asyncio.Event(), server.requests.cancel)
        assert (await finishing).status == 200 and integ_fns.OUTCOMES["drained"] == "done"  # it had 60 s

    slow = IntegrationConfig(function="waits", backend="inproc", builtins=False)  # 5 s a call
    server = RewardServer(slow, port=0, registry=REG, drain_s=60)
    await server.start()
    async with aiohttp.ClientSession() as http:
        hanging = asyncio.create_task(http.post(server.url, json=body("cut-short")))
        await until_in_flight(server)
        t0 = time.monotonic()
        again = asyncio.Event()
        closing = asyncio.create_task(close_in_two_steps(server.aclose(), again, server.requests.cancel))
        await asyncio.sleep(0.2)
        assert not closing.done()  # draining: the call has 60 s
        again.set()  # Ctrl-C again
        await closing
        assert time.monotonic() - t0 < 4  # not the call's 5 s, nor the 60 s drain
        with pytest.raises(aiohttp.ClientError):
            await hanging
    assert integ_fns.OUTCOMES["cut-short"] == "cancelled"


async def test_openrlhf_http_a_zero_drain_cancels_at_once():
    """drain_s 0 went to aiohttp's shutdown_timeout, where 0 is no limit: the close waited
    for the call to end."""
    import aiohttp

    slow = IntegrationConfig(function="waits", backend="inproc", builtins=False, constants={"delay_s": 20})
    server = RewardServer(slow, port=0, registry=REG, drain_s=0)
    await server.start()
    async with aiohttp.ClientSession() as http:
        hanging = asyncio.create_task(http.post(server.url, json={"query": ["q"], "labels": ["zero-drain"]}))
        for _ in range(3000):
            if server.requests:
                break
            await asyncio.sleep(0.01)
        assert server.requests
        t0 = time.monotonic()
        await server.aclose()
        assert time.monotonic() - t0 < 10  # not the call's 20 s
        with pytest.raises(aiohttp.ClientError):
            await hanging
    assert integ_fns.OUTCOMES["zero-drain"] == "cancelled"


def test_cli_openrlhf_serve_serves_until_interrupted(tmp_path):
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    SERVE = [sys.executable, "-m", "fabric.cli", "integrate", "openrlhf-serve"]
    here = str(Path(__file__).parent)  # not relative: the working directory may be anywhere
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            *SERVE,
            "-f",
            "contains",
            "-m",
            "integ_fns",
            "--port",
            "0",
            "--backend",
            "inproc",
            "--arg",
            "answer=label",
            "--max-body-mb",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = json.loads(line)["url"]
        req = urllib.request.Request(
            url,
            data=json.dumps({"query": ["p 5"], "prompts": ["p"], "labels": ["5"]}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["rewards"] == [1.0]
        big = {"query": ["p " + "x" * 600_000] * 2, "prompts": ["p"] * 2, "labels": ["5"] * 2}
        req = urllib.request.Request(url, data=json.dumps(big).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413  # --max-body-mb 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # Ctrl-C's exit status, as fabric run's
    bad = subprocess.run(
        [*SERVE, "-f", "nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown function 'nope'" in bad.stderr and "math_answer" in bad.stderr


def test_a_failed_batch_s_error_pickles_back_whole():
    # raised in veRL's Ray reward actor as RefusedArgumentsError is: it takes four arguments,
    # and pickle rebuilt it from its message alone (a TypeError in place of the failure)
    import pickle

    from fabric.integrations import RewardCallError
    from fabric.protocol import ErrorInfo

    e = RewardCallError("f", 8, [(3, ErrorInfo(type="UserError", message="boom"))], hint="; a hint")
    copy = pickle.loads(pickle.dumps(e))
    assert isinstance(copy, RewardCallError) and str(copy) == str(e)
    assert (copy.function, copy.total, copy.hint) == ("f", 8, "; a hint")
    assert [(i, x.type, x.message) for i, x in copy.failures] == [(3, "UserError", "boom")]


def test_the_servers_url_brackets_an_ipv6_address():
    # --host ::1 printed http://::1:8000/get_reward, which no client parses
    cfg = IntegrationConfig(function="length", backend="inproc", builtins=False)
    assert RewardServer(cfg, host="::1", port=8000, registry=REG).url == "http://[::1]:8000/get_reward"
    assert (
        RewardServer(cfg, host="127.0.0.1", port=8000, registry=REG).url == "http://127.0.0.1:8000/get_reward"
    )
