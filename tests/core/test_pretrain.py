"""Pretraining a new tiny-lm on random play: what it trains on, that it learns, that it is
deterministic, and the configs it refuses."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError
from core.policy.build import build_policy
from core.policy.corpus import play_envs
from core.policy.pretrain import Transitions, held_out_split, pretrain, transition_sequences
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.env_manager import EnvManager, task_key
from fabric.protocol import Message

ACTIONS = ["left", "right", "up", "down"]
SHAPE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 128}


def _cfg(*, pretrain: dict | None = None, prompt: dict | None = None, **engine) -> JobConfig:
    env = {
        "id": "frozenlake-v1",
        "tag": "fl",
        "max_turns": 6,
        "kwargs": {"size": 4, "neighbours": True},
        "actions": ACTIONS,
        "prompt": prompt if prompt is not None else {"history": 0, "drop_lines": ["Legend:"]},
    }
    data = {
        "engine": {
            "backend": "torch",
            "max_new_tokens": 1,
            "kwargs": SHAPE,
            "pretrain": pretrain or {},
            **engine,
        },
        "envs": [env],
        "rewards": {"fl": [{"function": "env_return"}]},
        "seed": 5,
    }
    return JobConfig.from_dict(data)


def test_episodes_carry_the_actions_between_their_observations():
    played = play_envs(_cfg(), episodes=6)
    assert len(played.episodes) == 6
    for ep in played.episodes:
        assert len(ep.texts) == len(ep.actions) + 1 and set(ep.actions) <= set(ACTIONS)
        assert ep.texts[0].startswith("FrozenLake 4x4")
    assert play_envs(_cfg(), episodes=6) == played  # seeded


def test_a_transition_is_the_prompt_the_policy_sees_then_the_action_and_what_followed():
    cfg = _cfg()
    played = play_envs(cfg, episodes=3)
    tok = WordTokenizer.train(played.texts)
    data = transition_sequences(cfg, tok, played.episodes, max_len=10_000)
    seqs = data.seqs
    assert len(seqs) == len(data.tasks) == sum(len(ep.actions) for ep in played.episodes)
    ep = played.episodes[0]
    assert set(data.tasks[: len(ep.actions)]) == {task_key(ep.texts[0])}  # the episode's map
    first, second = (tok.decode(s, skip_special=False) for s in seqs[:2])
    assert first.startswith("<bos> <|user|> FrozenLake 4 x 4:")
    assert f"<|assistant|> {ep.actions[0]} <|end|> <|user|>" in first
    assert "Legend" not in first + second  # drop_lines, as in the policy's prompt
    # history 0: the second transition's prompt is the latest observation only, exactly
    # what EnvManager shows the policy at that turn
    env = cfg.envs[0]
    history = [Message(role="user", content=ep.texts[0]), Message(role="assistant", content=ep.actions[0])]
    shown = EnvManager.context([*history, Message(role="user", content=ep.texts[1])], env)
    expect = tok.encode_chat(
        [
            *shown,
            Message(role="assistant", content=ep.actions[1]),
            Message(role="user", content=EnvManager.shown(ep.texts[2], env)),
        ],
        add_generation_prompt=False,
    )
    assert seqs[1] == expect and "FrozenLake" not in second


def test_a_sequence_longer_than_the_model_keeps_its_head_and_a_prompt_that_does_not_fit_is_refused():
    cfg = _cfg()
    played = play_envs(cfg, episodes=2)
    tok = WordTokenizer.train(played.texts)
    full = transition_sequences(cfg, tok, played.episodes, max_len=10_000).seqs

    def fits(n: int) -> bool:
        try:
            transition_sequences(cfg, tok, played.episodes, max_len=n)
            return True
        except ConfigError:
            return False

    # the shortest context that holds every prompt and its action
    need = next(n for n in range(1, max(map(len, full)) + 1) if fits(n))
    cut = transition_sequences(cfg, tok, played.episodes, max_len=need).seqs
    assert any(len(s) > need for s in full)  # some next observations were cut
    assert [s[:need] for s in full] == cut
    with pytest.raises(ConfigError, match=r"engine\.kwargs\.max_len") as e:
        transition_sequences(cfg, tok, played.episodes, max_len=need - 1)
    assert f"take {need} tokens" in str(e.value)


def test_the_held_out_loss_is_on_maps_never_trained_on():
    cfg = _cfg()
    played = play_envs(cfg, episodes=60)
    tok = WordTokenizer.train(played.texts)
    data = transition_sequences(cfg, tok, played.episodes, max_len=10_000)
    assert len(set(data.tasks)) < len(played.episodes)  # seeds repeat maps: the reason
    train, held = held_out_split(data, random.Random(0))
    assert held and train and len(train) + len(held) == len(data.seqs)
    task_of = {}
    for seq, task in zip(data.seqs, data.tasks, strict=True):
        task_of.setdefault(tuple(seq), set()).add(task)
    held_tasks = set().union(*(task_of[tuple(s)] for s in held))
    train_tasks = set().union(*(task_of[tuple(s)] for s in train))
    assert not held_tasks & train_tasks
    # one map only: nothing can be held out by map, so single sequences are
    one = Transitions(data.seqs[:40], ["same"] * 40)
    train, held = held_out_split(one, random.Random(0))
    assert len(held) == 2 and len(train) == 38


def test_pretraining_lowers_the_held_out_loss_and_is_deterministic():
    cfg = _cfg(pretrain={"steps": 40, "episodes": 40, "batch_size": 32})
    a, b = build_policy(cfg), build_policy(cfg)
    report = a.pretrained
    assert report["steps"] == 40 and report["sequences"] > 40
    # from ~ln(vocab) to well under it: the model learned the text, not a constant
    assert report["held_out_loss_after"] < 0.6 * report["held_out_loss_before"]
    assert (
        a.tokenizer == b.tokenizer
        and a.pretrained["held_out_loss_after"] == b.pretrained["held_out_loss_after"]
    )
    for k, v in a.state.items():
        assert torch.equal(v, b.state[k]), k
    # and off by default: the same config without it gives the random initialisation
    plain = build_policy(_cfg())
    assert not plain.pretrained
    assert any(not torch.equal(v, plain.state[k]) for k, v in a.state.items())


def test_pretraining_stops_at_the_next_step_once_asked():
    # the job's Ctrl-C sets the flag from the event loop's thread; the build runs in another
    import threading

    from core.errors import StoppedError

    stop = threading.Event()
    steps: list[int] = []

    def on_step(step: int, total: int, loss: float) -> None:
        steps.append(step)
        if step == 3:
            stop.set()

    cfg = _cfg(pretrain={"steps": 1000, "episodes": 10, "batch_size": 4})
    with pytest.raises(StoppedError, match="after 3 of 1000 steps"):
        build_policy(cfg, on_pretrain_step=on_step, stop=stop)
    assert steps == [1, 2, 3]


def test_pretrain_refuses_too_few_transitions():
    model = TinyLM(TinyLMConfig(vocab_size=8, **SHAPE))
    with pytest.raises(ValueError, match="at least 2 transitions"):
        pretrain(model, Transitions([[1, 2, 3]], ["a"]), _cfg().engine.pretrain, seed=0)


@pytest.mark.parametrize(
    ("engine", "why"),
    [
        ({"model": "runs/some-saved-policy"}, "pretraining builds a new tiny-lm"),
        ({"backend": "openai", "model": "gpt-4o-mini", "kwargs": {}}, "this engine is openai"),
    ],
)
def test_pretraining_needs_a_new_tiny_lm(engine, why):
    with pytest.raises(ConfigError) as e:
        _cfg(pretrain={"steps": 10}, **engine)
    [(key, msg)] = [p for p in e.value.problems if p[0].startswith("engine.pretrain")]
    assert key == "engine.pretrain.steps" and why in msg and "set steps to 0" in msg


@pytest.mark.parametrize(
    ("pre", "key"),
    [
        ({"steps": -1}, "engine.pretrain.steps"),
        ({"steps": 5, "lr": 0}, "engine.pretrain.lr"),
        ({"steps": 5, "episodes": 0}, "engine.pretrain.episodes"),
        ({"steps": 5, "epochs": 2}, "engine.pretrain.epochs"),
    ],
)
def test_bad_pretrain_settings_name_the_key(pre, key):
    with pytest.raises(ConfigError) as e:
        _cfg(pretrain=pre)
    assert key in [k for k, _ in e.value.problems]


_FINGERPRINT = """
import hashlib, json, sys
from core.config import JobConfig
from core.policy.build import build_policy
b = build_policy(JobConfig.from_dict(json.loads(sys.stdin.read())))
h = hashlib.sha256(json.dumps(b.tokenizer, sort_keys=True).encode())
for k in sorted(b.state):
    h.update(k.encode() + b.state[k].numpy().tobytes())
print(h.hexdigest(), json.dumps(b.pretrained["held_out_loss_after"]))
"""


def test_the_pretrained_policy_does_not_depend_on_the_hash_seed(tmp_path):
    """Sets and dicts of strings iterate in hash order: a corpus, vocabulary or split built
    from one would change with PYTHONHASHSEED, i.e. from one run of the job to the next."""
    cfg = _cfg(pretrain={"steps": 5, "episodes": 20, "batch_size": 16})
    spec = json.dumps(cfg.model_dump(mode="json", exclude_unset=True))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec)
    procs = []
    try:
        for hash_seed in ("1", "2"):  # side by side: each is seconds of imports and corpus play
            with spec_file.open() as stdin:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _FINGERPRINT],
                        stdin=stdin,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env={**os.environ, "PYTHONHASHSEED": hash_seed},
                    )
                )
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            outs.append(out.split())
    finally:
        for proc in procs:  # nothing left running when one fails
            proc.kill()
            proc.wait()
    assert outs[0] == outs[1]
