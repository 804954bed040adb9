"""Regression tests from a review of the scheduling policies and the simulator (units,
clocks and rules end to end): each pins a failure that was demonstrated before its fix."""

from __future__ import annotations

from core.sched.base import Request
from core.sim import Simulator, TrajSpec, Turn


def test_a_trajectory_that_moves_worker_in_the_simulator_keeps_its_cmlfq_level():
    # The real path keeps C-MLFQ's levels in one store for every replica's queue, so a
    # trajectory cache_affinity moves keeps its level; the simulator gave each worker a
    # queue of its own, and a moved trajectory started again at level 0 there.
    trajs = [
        # two turns whose tool calls error: level 1 after the first, level 2 after the second
        TrajSpec("a", 16, (Turn(1500, 10.0, "tool_error"), Turn(1500, 10.0, "tool_error"), Turn(10))),
        TrajSpec("c", 16, (Turn(6000),)),  # keeps a's first worker loaded
        TrajSpec("x", 16, (Turn(10),)),  # predicted long at first: the other worker is x's
    ]

    def predict(spec: TrajSpec, turn: int) -> float:
        if spec.id != "a":
            return {"x": 10_000.0, "c": 100.0}[spec.id]
        # a stays on its worker at turn 1, and has little left at turn 2: it moves then
        return {0: 100.0, 1: 10_000.0}.get(turn, sum(t.gen_tokens for t in spec.turns[:turn]) + 1.0)

    sim = Simulator(trajs, workers=2, scheduler="cmlfq", placement="cache_affinity", predictor=predict)
    levels: list[tuple[str, int, int]] = []
    for name, queue in sim.queues.items():
        push = queue.push

        def spy(req: Request, now: float, _push=push, _name=name, _q=queue) -> None:
            _push(req, now)
            if req.trajectory == "a":
                levels.append((_name, req.turn, _q.level_of("a")))  # type: ignore[attr-defined]

        queue.push = spy  # type: ignore[method-assign]
    res = sim.run()
    assert res.meta["migrations"] == 1
    (home, _, _), (_, _, one), (moved, _, two) = levels
    assert moved != home and one == 1
    assert two == 2  # was 1: 0 on the new worker's queue, then one level down
