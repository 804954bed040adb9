"""Does the embedded-default policy learn? GRPO on text FrozenLake, in process, on 2 CPU cores.

    .venv/bin/python benchmarks/frozenlake_learning.py                  # ~10 minutes
    .venv/bin/python benchmarks/frozenlake_learning.py --budget-s 120   # a shorter run

A ``TinyLM`` (word tokenizer, random init, ~100k parameters) plays ``frozenlake-v1`` (a
random 4x4 map per seed, not slippery, at most ``--max-turns`` 10 turns) through the APIs the
core job uses: ``Engine.generate`` per turn for every episode of the batch at once
(``asyncio.gather``), turns recorded with ``assistant_message`` into a ``Trajectory``, turned
into ``TrainSample``s by ``turn_samples``, ``Trainer.step``, then ``suspend`` /
``load_weights(update.state, update.version)`` / ``resume``. No Ray, no async bound.

Design (each choice measured; see the report in docs or the issue):

* **Episode = conversation.** The observation is the user turn, the model's reply the
  assistant turn. The context is the *latest observation only* (it is the whole state: map
  with ``@`` and the position line), without its last line, the legend, which is the same
  every turn (``--legend drop``; ``keep`` / ``system`` are the alternatives). Prompts are
  ~40 tokens.
* **Constrained decoding** (``GenerateRequest.allowed_token_ids``, as vLLM's): the reply is
  one token among ``left right up down`` (``--reply-tokens 1``; the chat template closes
  the turn). Without it (``--no-constrain``) the model learns the format in ~40 steps (a
  -0.1 penalty per invalid reply share) but then settles on a state-independent
  right/down coin flip, greedy success 0, in 10 minutes: learning to emit valid words
  pushes the last position toward a constant that drowns the map.
* **Advantages**: GRPO's episode-level group advantage (groups: ``--group-size`` 8
  episodes of one map, ``--groups`` 8 maps per step) plus GiGPO's step-level advantage
  (turns taken in the same state of the same map, compared by discounted return,
  ``--gamma`` 0.95), both centred but not divided by the std (``--no-scale`` is the default;
  dividing amplified tiny return differences and collapsed the policy's entropy).
* **Trainer**: AdamW, one update per step on the whole batch, clip 0.2/0.28, grad clip 1,
  entropy bonus 0.01, lr 2e-3 decayed linearly to 5e-4 over the wall-time budget.

This harness trains **from random weights**: it is the from-scratch ablation. The main job
(``make demo``) now pretrains the TinyLM on random play first (``engine.pretrain``) and uses
lr 1e-3 and entropy 0.03; without that step this recipe passes 0.7 in about half of its
runs within 10 minutes (docs/job.md, "The embedded-default policy and its pretraining").

Success rate is measured on held-out seeds (never training seeds; their maps can repeat:
docs/job.md) with **greedy** actions at step 0 (the untrained policy) and every
``--eval-every`` steps; the end also reports the
sampled (temperature 1) success. Prints a line per step and one JSON object at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import envpool
import envpool.envs
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Engine, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.trainer.base import TrainSample, assistant_message, turn_samples
from core.trainer.grpo import discounted_returns, group_advantages, step_advantages
from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig
from fabric.protocol import Message, Trajectory

ENV_ID = "frozenlake-v1"
ACTIONS = ("left", "right", "up", "down")
LEGEND = "Legend: @ you, S start, F frozen (safe), H hole, G goal. Row 0 is the top row."
EVAL_SEED_BASE = 10_000_000  # training seeds are drawn below it (seeds, not maps: 4x4 maps repeat)


def build_tokenizer() -> WordTokenizer:
    """The vocabulary of FrozenLake's text: observations of seeded random walks, an invalid
    reply, the action words. Deterministic (same corpus -> same ids)."""
    rng = random.Random(0)
    corpus = [" ".join(ACTIONS)]
    env = envpool.make(ENV_ID)
    for seed in range(200):
        obs, _ = env.reset(seed=seed)
        corpus.append(obs.text)
        corpus.append(env.step("hole").obs.text)  # "Invalid action 'hole'..."
        for _ in range(12):
            res = env.step(rng.choice(ACTIONS))
            corpus.append(res.obs.text)
            if res.done:
                break
    return WordTokenizer.train(corpus)


def parse_action(text: str) -> str:
    """The reply's first word (the environment judges it); an empty reply stays empty."""
    words = text.split()
    return words[0] if words else text


@dataclass
class Episode:
    traj: Trajectory
    success: bool
    states: list[str]
    """Per turn: the state the reply was made in (the observation without its message line)."""
    turn_rewards: list[float]
    invalid: int
    unended: int

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def reward(self) -> float:
        return sum(self.turn_rewards)


def context(messages: list[Message], args: argparse.Namespace) -> list[Message]:
    """What the policy is shown: the latest observation plus the last ``history`` (reply,
    observation) pairs. ``--legend drop`` cuts the observation's last line, the legend, which
    is the same every turn (no information for the policy); ``system`` shows it once as a
    system message instead; ``keep`` leaves observations whole."""
    window = messages[-(2 * args.history + 1) :]
    if args.legend == "keep":
        return window
    out = [
        m if m.role != "user" else m.model_copy(update={"content": strip_legend(m.content or "")})
        for m in window
    ]
    return [Message(role="system", content=LEGEND), *out] if args.legend == "system" else out


def strip_legend(text: str) -> str:
    head, _, last = text.rpartition("\n")
    return head if last.startswith("Legend:") else text


async def play(
    engine: Engine, seed: int, args: argparse.Namespace, *, greedy: bool, group_id: str = ""
) -> Episode:
    env = envpool.make(ENV_ID)
    obs, _ = env.reset(seed=seed)
    messages = [Message(role="user", content=obs.text)]
    states: list[str] = []
    rewards: list[float] = []
    success, invalid, unended, truncated = False, 0, 0, True
    for _ in range(args.max_turns):
        c = await engine.generate(
            GenerateRequest(
                messages=context(messages, args),
                max_new_tokens=args.reply_tokens,
                allowed_token_ids=args.allowed,
                temperature=0.0 if greedy else 1.0,
            )
        )
        states.append(str(messages[-1].content).split("\n", 1)[-1])
        messages.append(assistant_message(c))
        res = env.step(parse_action(c.text))
        bad, open_ = not res.info.get("valid", True), c.finish_reason != "stop"
        invalid += bad
        unended += open_
        rewards.append(res.reward - (0.1 * bad + 0.05 * open_ * (args.reply_tokens > 1)) / args.max_turns)
        messages.append(Message(role="user", content=res.obs.text))
        if res.done:
            success, truncated = res.reward > 0, False
            break
    traj = Trajectory(
        messages=messages,
        task={"env_id": ENV_ID, "seed": seed, "group_id": group_id},
        status="truncated" if truncated else "ok",
        env_reward=float(success),
    )
    return Episode(traj, success, states, rewards, invalid, unended)


def advantages(episodes: list[Episode], args: argparse.Namespace) -> list[list[float]]:
    """Per episode, per turn: the episode-level group advantage plus ``step_adv`` x the
    step-level (GiGPO) advantage of the state the turn was taken in."""
    groups = [e.traj.task["group_id"] for e in episodes]
    episode = group_advantages([e.reward for e in episodes], groups, scale=args.scale).tolist()
    returns, turn_groups, states = [], [], []
    for e, g in zip(episodes, groups, strict=True):
        returns += discounted_returns(e.turn_rewards, args.gamma)
        turn_groups += [g] * e.turns
        states += e.states
    step = iter(step_advantages(returns, turn_groups, states, scale=args.scale).tolist())
    return [
        [a + args.step_adv * next(step) for _ in e.states] for e, a in zip(episodes, episode, strict=True)
    ]


async def evaluate(
    engine: Engine, seeds: list[int], args: argparse.Namespace, *, greedy: bool = True
) -> dict[str, float]:
    eps = await asyncio.gather(*(play(engine, s, args, greedy=greedy) for s in seeds))
    return {
        "success": sum(e.success for e in eps) / len(eps),
        "invalid_rate": sum(e.invalid for e in eps) / sum(e.turns for e in eps),
        "mean_turns": sum(e.turns for e in eps) / len(eps),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    tok = build_tokenizer()
    args.allowed = None
    if args.constrain:
        args.allowed = [tok.token_to_id(a) for a in ACTIONS] + ([tok.end_id] if args.reply_tokens > 1 else [])
    cfg = TinyLMConfig(
        vocab_size=tok.vocab_size,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        max_len=args.max_len,
    )
    policy = TinyLM(cfg, seed=args.seed)
    trainer = TorchTrainer(
        policy,
        TorchTrainerConfig(
            lr=args.lr,
            mini_batch_size=args.mini_batch,
            epochs=args.epochs,
            clip_low=0.2,
            clip_high=0.28,
            kl_coef=args.kl_coef,
            entropy_coef=args.entropy_coef,
            grad_clip=1.0,
            seed=args.seed,
        ),
    )
    engine = TorchEngine(
        policy,
        tok,
        TorchEngineConfig(max_batch_size=512, batch_wait_ms=1.0, num_threads=args.threads, seed=args.seed),
    )
    rng = random.Random(args.seed)
    eval_seeds = [EVAL_SEED_BASE + i for i in range(args.eval_episodes)]
    curve: list[dict[str, Any]] = []
    train_curve: list[dict[str, Any]] = []
    spent = {"rollout_s": 0.0, "train_s": 0.0, "eval_s": 0.0, "weights_s": 0.0}
    reached: dict[str, Any] | None = None
    t0 = time.perf_counter()  # the learning clock starts after setup (tokenizer, model)

    async def eval_point(step: int) -> dict[str, Any]:
        nonlocal reached
        te = time.perf_counter()
        res = await evaluate(engine, eval_seeds, args)
        spent["eval_s"] += time.perf_counter() - te
        point = {
            "step": step,
            "wall_s": round(time.perf_counter() - t0, 1),
            **{k: round(v, 4) for k, v in res.items()},
        }
        curve.append(point)
        if reached is None and res["success"] >= args.target:
            reached = {"step": step, "wall_s": point["wall_s"]}
        print(f"  eval step {step:4d}  t={point['wall_s']:6.1f}s  success={res['success']:.3f}", flush=True)
        return point

    async with engine:
        untrained = await eval_point(0)
        step = 0
        last_eval_cost = spent["eval_s"]
        while True:
            elapsed = time.perf_counter() - t0
            if step >= args.max_steps or elapsed + last_eval_cost * 1.5 + 2.0 > args.budget_s:
                break
            step += 1
            tr = time.perf_counter()
            seeds = [rng.randrange(EVAL_SEED_BASE) for _ in range(args.groups)]
            jobs = [
                play(engine, s, args, greedy=False, group_id=f"{step}-{g}")
                for g, s in enumerate(seeds)
                for _ in range(args.group_size)
            ]
            episodes = await asyncio.gather(*jobs)
            spent["rollout_s"] += time.perf_counter() - tr
            batch: list[TrainSample] = []
            for ep, adv in zip(episodes, advantages(episodes, args), strict=True):
                turns = turn_samples(ep.traj, reward=ep.reward, group_id=ep.traj.task["group_id"])
                batch += [t.model_copy(update={"advantage": a}) for t, a in zip(turns, adv, strict=True)]
            tt = time.perf_counter()
            if args.lr_end is not None:  # linear decay over the wall-time budget
                frac = min(1.0, (time.perf_counter() - t0) / args.budget_s)
                trainer.set_lr(args.lr + frac * (args.lr_end - args.lr))
            metrics = await asyncio.to_thread(trainer.step, batch)
            spent["train_s"] += time.perf_counter() - tt
            tw = time.perf_counter()
            update = trainer.publish()
            await engine.suspend()
            await engine.load_weights(update.state, update.version)
            await engine.resume()
            spent["weights_s"] += time.perf_counter() - tw
            row = {
                "step": step,
                "wall_s": round(time.perf_counter() - t0, 1),
                "train_success": round(sum(e.success for e in episodes) / len(episodes), 4),
                "invalid_rate": round(sum(e.invalid for e in episodes) / sum(e.turns for e in episodes), 4),
                "reward": round(sum(e.reward for e in episodes) / len(episodes), 4),
                "samples": len(batch),
                **{k: round(metrics[k], 4) for k in ("loss", "entropy", "grad_norm", "clip_frac", "tokens")},
            }
            train_curve.append(row)
            print(
                f"step {step:4d}  t={row['wall_s']:6.1f}s  train_success={row['train_success']:.3f}  "
                f"invalid={row['invalid_rate']:.3f}  reward={row['reward']:+.3f}  "
                f"entropy={row['entropy']:.3f}  samples={len(batch)}",
                flush=True,
            )
            if step % args.eval_every == 0:
                te0 = spent["eval_s"]
                await eval_point(step)
                last_eval_cost = spent["eval_s"] - te0
        final = curve[-1] if curve[-1]["step"] == step else await eval_point(step)
        sampled = await evaluate(engine, eval_seeds, args, greedy=False)
    wall = time.perf_counter() - t0
    if args.save:
        policy.save_pretrained(args.save)
        tok.save(f"{args.save}/tokenizer.json")
    return {
        "benchmark": "frozenlake_learning",
        "env": ENV_ID,
        "eval_policy": "greedy",
        "eval_seeds": f"{EVAL_SEED_BASE}..{EVAL_SEED_BASE + args.eval_episodes - 1} (held-out seeds)",
        "untrained_success": untrained["success"],
        "final_success": final["success"],
        "final_success_sampled": round(sampled["success"], 4),
        "best_success": max(p["success"] for p in curve),
        "target": args.target,
        "reached_target": reached,
        "steps": step,
        "episodes_trained": step * args.groups * args.group_size,
        "wall_s": round(wall, 1),
        "setup_s": round(t0 - t_start, 1),
        "process_wall_s": round(time.perf_counter() - t_start, 1),
        "time_s": {k: round(v, 1) for k, v in spent.items()},
        "model": {**cfg.model_dump(), "parameters": policy.num_parameters},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "save")},
        "engine_stats": engine.stats,
        "curve": curve,
        "train_curve": train_curve[:: args.eval_every],  # every eval_every-th step, to keep it short
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--budget-s", type=float, default=570.0, help="learning wall-time budget (setup excluded)"
    )
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--groups", type=int, default=8, help="maps (GRPO groups) per step")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per map")
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=1, help="max_new_tokens per turn")
    ap.add_argument(
        "--no-constrain", dest="constrain", action="store_false", help="sample from the whole vocabulary"
    )
    ap.add_argument("--legend", choices=["keep", "system", "drop"], default="drop")
    ap.add_argument("--history", type=int, default=0, help="earlier (reply, observation) pairs shown")
    ap.add_argument(
        "--step-adv", type=float, default=1.0, help="weight of the GiGPO step advantage; 0 = GRPO"
    )
    ap.add_argument("--gamma", type=float, default=0.95, help="discount of the step-level returns")
    ap.add_argument("--scale", action="store_true", help="divide advantages by the group std (GRPO's form)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-end", type=float, default=5e-4, help="linear decay to this over the budget")
    ap.add_argument(
        "--mini-batch", type=int, default=None, help="samples per optimizer update (default: all)"
    )
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--entropy-coef", type=float, default=0.01)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON result here")
    ap.add_argument(
        "--save", help="save the trained policy (save_pretrained) and tokenizer to this directory"
    )
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
