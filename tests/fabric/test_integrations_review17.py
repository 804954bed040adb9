"""fabric.integrations against the frameworks' own calling code (review 17): what their source
does with a reward file or function that the adapters' earlier tests did not do."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import pickle
import subprocess
import sys

import pytest
from integ_fns import REG
from integ_helpers import trl_kwargs

import fabric.integrations.openrlhf as openrlhf_mod
from fabric.integrations import BadBatchError
from fabric.integrations.trl import trl_async_reward, trl_reward
from fabric.integrations.verl import VerlReward


def _load_as_openrlhf_does(path: str):
    """OpenRLHF's loading of ``--remote_rm_url file.py``: a module named ``reward_func``,
    not put in ``sys.modules``, so nobody can import it by that name."""
    spec = importlib.util.spec_from_file_location("reward_func", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call_unpickled_in_a_child(blob: bytes, tmp_path) -> subprocess.CompletedProcess[bytes]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")},
        "FABRIC_FUNCTION": "exact_match",
        "FABRIC_BACKEND": "inproc",
    }
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); "
            "print(f(['p Answer: 4'], ['p'], ['4'])['rewards'])",
        ],
        input=blob,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )


def test_the_openrlhf_file_loaded_by_path_pickles_by_reference(tmp_path):
    """OpenRLHF 0.8's ``RemoteRewardModel`` runs the file's function as a Ray task
    (``ray.remote(reward_module.reward_func)``), which pickles it. Defined in the file loaded
    by path, it belonged to a module nobody can import: pickle refused it ("import of module
    'reward_func' failed"), and cloudpickle, copying it by value with the globals it reads,
    failed on the module's lock ("cannot pickle '_thread.lock' object"). Defined in an
    importable module it goes by reference and is rebuilt by import in the Ray worker."""
    loaded = _load_as_openrlhf_does(openrlhf_mod.__file__)
    blob = pickle.dumps(loaded.reward_func)  # what cloudpickle does with an importable function
    child = _call_unpickled_in_a_child(blob, tmp_path)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().strip() == "[1.0]"


def test_the_openrlhf_file_loaded_by_path_goes_through_cloudpickle(tmp_path):
    cloudpickle = pytest.importorskip("cloudpickle")  # Ray's pickler; not a dependency here
    loaded = _load_as_openrlhf_does(openrlhf_mod.__file__)
    child = _call_unpickled_in_a_child(cloudpickle.dumps(loaded.reward_func), tmp_path)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().strip() == "[1.0]"


def test_an_async_trl_reward_reads_as_a_coroutine_function_itself():
    """TRL releases before ``is_async_callable`` (the ``GRPOTrainer._calculate_rewards`` with
    ``log_metric`` and ``self.async_loop``) pick the async reward functions with
    ``inspect.iscoroutinefunction(reward_func)``, which is False for an instance whose
    ``__call__`` is async: TRL called ``trl_async_reward(...)`` as a sync function, got a
    coroutine back, and failed iterating it ("'coroutine' object is not iterable")."""
    sync = trl_reward("length", registry=REG, backend="inproc")
    reward = trl_async_reward("length", registry=REG, backend="inproc")
    try:
        assert inspect.iscoroutinefunction(reward) and asyncio.iscoroutinefunction(reward)
        assert not inspect.iscoroutinefunction(sync) and not asyncio.iscoroutinefunction(sync)
        # what inspect says of its parameters is TRL's calling convention, not __call__'s self
        assert list(inspect.signature(reward).parameters) == ["prompts", "completions", "kwargs"]
        kw = trl_kwargs(2)
        kw.pop("_metrics")

        async def as_those_releases_call_it():  # awaited on TRL's own loop thread
            return await reward(prompts=["p", "p"], completions=["ab", "abc"], **kw)

        assert asyncio.run(as_those_releases_call_it()) == [2.0, 3.0]
    finally:
        sync.close()
        reward.close()


def test_verl_batch_lists_that_are_none_or_not_lists_are_clear():
    """veRL's batch convention passes four lists; a caller of it (an evaluation script scoring
    saved outputs) passes ``data_sources=None`` as ``extra_infos`` may be: that was a
    ``TypeError`` ("object of type 'NoneType' has no len()"). A None list is none for every
    sample, as ``extra_infos``'s is; ``solution_strs`` None, or a single string where a list
    goes, is a ``BadBatchError`` that says so, not a batch of one sample per character."""
    reward = VerlReward("length", registry=REG, backend="inproc")
    try:
        out = reward.compute_score_batch(None, ["ab", "abc"], None, None)
        assert [d["score"] for d in out] == [2.0, 3.0]
        with pytest.raises(BadBatchError, match="solution_strs must be a list"):
            reward.compute_score_batch(None, None, None)
        with pytest.raises(BadBatchError, match="solution_strs must be a list"):
            reward.compute_score_batch("d", "Answer: 4", "4")
        with pytest.raises(BadBatchError, match="ground_truths must be a list"):
            reward.compute_score_batch(["d"], ["Answer: 4"], "4")
    finally:
        reward.close()


def test_trl_prompts_and_completions_that_are_not_lists_are_clear():
    """TRL passes lists; a None was a ``TypeError`` (``len(None)``) and a string was scored as
    one completion per character (and ``prompts="p"`` beside one completion passed)."""
    with trl_reward("length", registry=REG, backend="inproc") as reward:
        kw = trl_kwargs(1)
        kw.pop("_metrics")
        with pytest.raises(BadBatchError, match="completions must be a list"):
            reward(prompts=["p"], completions=None, **kw)
        with pytest.raises(BadBatchError, match="completions must be a list"):
            reward(prompts=["p"], completions="abc", **kw)
        with pytest.raises(BadBatchError, match="prompts must be a list"):
            reward(prompts="p", completions=["abc"], **kw)
        assert reward(prompts=["p"], completions=("abc",), **kw) == [3.0]
