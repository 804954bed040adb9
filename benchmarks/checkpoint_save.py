"""How long a checkpoint holds the job's step loop: the whole save vs the snapshot the job now waits for.

    .venv/bin/python benchmarks/checkpoint_save.py      # ~1 minute on 2 cores, ~4 GiB of RAM

A ``TrainerActor`` (the job's trainer, here in-process) with a TinyLM of about 100 M
parameters, trained one step so Adam's moments exist. Each round, in the same process:
  save       ``TrainerActor.save``: copy, write, fsync; what the step loop waited for before
  snapshot   ``TrainerActor.snapshot``: the copy only; what it waits for now, while a thread
             writes the file (``written`` waits for the disk beside the next step)
  step       one training step alone, and one taken while the snapshot's file is written
             (the write shares the machine's cores and disk with it)
Prints one JSON object: the medians over the rounds and ``blocked_ratio`` (save / snapshot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024, help="TinyLM width (%(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="TinyLM layers (%(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (%(default)s)")
    args = ap.parse_args(argv)

    import torch

    from core.config import TrainerConfig
    from core.config_backends import TinyLMConfig
    from core.policy.build import PolicyBundle
    from core.policy.tiny_lm import TinyLM
    from core.policy.tokenizer import WordTokenizer
    from core.trainer.actor import TrainerActor
    from core.trainer.base import TrainSample

    torch.manual_seed(0)
    tok = WordTokenizer(["left", "right", "up", "down"])
    shape = TinyLMConfig(vocab_size=tok.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    model = TinyLM(shape, seed=0)
    params = sum(p.numel() for p in model.parameters())
    bundle = PolicyBundle(tokenizer=tok.to_dict(), model_config=shape.model_dump(), state=model.state_dict())
    del model
    actor = TrainerActor(TrainerConfig(lr=1e-4), bundle, total_steps=100, temperature=1.0, seed=0)
    right, left = tok.token_to_id("right"), tok.token_to_id("left")
    batch = [
        TrainSample(
            prompt_ids=[1, 2, 3],
            completion_ids=[right if i % 2 else left],
            old_logprobs=[-1.4],
            advantage=1.0 if i % 2 else -1.0,
            group_id="g",
            policy_version=0,
        )
        for i in range(4)
    ]
    actor.step(batch)  # Adam's moments: a checkpoint's bulk

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    rows: dict[str, list[float]] = {
        "save_s": [],
        "snapshot_s": [],
        "write_s": [],
        "step_s": [],
        "step_during_write_s": [],
    }
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as d:
        for r in range(args.rounds):
            path = str(Path(d) / f"sync-{r}.pt")
            rows["save_s"].append(timed(lambda path=path: actor.save(path)))
            size = Path(path).stat().st_size
            Path(path).unlink()
            rows["step_s"].append(timed(lambda: actor.step(batch)))
            path = str(Path(d) / f"async-{r}.pt")
            t = time.perf_counter()
            rows["snapshot_s"].append(actor.snapshot(path))
            rows["step_during_write_s"].append(timed(lambda: actor.step(batch)))
            actor.written(path)
            rows["write_s"].append(time.perf_counter() - t)
            Path(path).unlink()
    med = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    print(
        json.dumps(
            {
                "params_m": round(params / 1e6, 1),
                "file_mb": round(size / 2**20),
                "rounds": args.rounds,
                **med,
                "blocked_ratio": round(med["save_s"] / max(med["snapshot_s"], 1e-9), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
