"""The progressive length predictor on the simulator's coding workload.

Trained online on 2,000 finished trajectories, evaluated on 1,000 others: after step 1
(the first turn and its tool outcome are known) and after step 2, on the trajectories still
running then. Reports Pearson r (log lengths) and the recall of the longest 10%. The same
figures for a prediction from the prompt alone (before step 1) are the baseline.

    .venv/bin/python benchmarks/length_predictor.py
"""

from __future__ import annotations

import argparse
import json
import math

from core.sched.predictor import LengthPredictor, pearson, top_recall
from core.sim import preset


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)  # no options: --help, and a clear error for anything else
    pred = LengthPredictor()
    for t in preset("coding", 2000, seed=0).trajectories:
        pred.observe(t.prompt_tokens, [(turn.gen_tokens, turn.outcome) for turn in t.turns])
    test = preset("coding", 1000, seed=1).trajectories
    out: dict[str, object] = {"trained_on": pred.trajectories_seen, "evaluated_on": len(test)}
    for step in (0, 1, 2):
        running = [t for t in test if len(t.turns) > step]
        guesses, truth = [], []
        for t in running:
            done = t.turns[:step]
            p = pred.predict(
                t.prompt_tokens, step, sum(x.gen_tokens for x in done), [x.outcome for x in done]
            )
            assert p is not None
            guesses.append(math.log(p))
            truth.append(math.log(t.total_tokens))
        out[f"step{step}"] = {
            "still_running": len(running),
            "pearson_r_log": round(pearson(guesses, truth), 3),
            "top10_recall": round(top_recall(guesses, truth), 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
