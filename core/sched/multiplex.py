"""Cross-job multiplexing (PlexRL): several RL jobs share training workers.

HRRS, highest response ratio with setup cost, picks which job's task a free worker runs
next::

    ratio = (wait + service + setup) / (service + setup)

where ``setup`` is paid only when the worker must swap the job's model in (it holds
another job's weights). Short tasks and long-waiting tasks rise; a task whose model is
already loaded is favoured (its setup is 0) without starving the others, since waiting
raises every ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    job: str
    arrival: float
    service_s: float
    """Expected run time once the model is loaded."""
    setup_s: float
    """Time to swap this job's model onto a worker that holds another one."""
    name: str = ""

    def __post_init__(self) -> None:
        # the response ratio divides by service + setup (0 when the model is loaded and the
        # task takes no time), and a negative time runs the worker's clock backwards
        if not 0 < self.service_s < math.inf or not 0 <= self.setup_s < math.inf:
            raise ValueError(f"a task needs 0 < service_s and 0 <= setup_s, both finite: {self}")
        if not math.isfinite(self.arrival):
            raise ValueError(f"a task's arrival must be finite: {self}")


def response_ratio(task: Task, now: float, loaded_job: str | None) -> float:
    setup = 0.0 if loaded_job == task.job else task.setup_s
    wait = max(now - task.arrival, 0.0)
    return (wait + task.service_s + setup) / (task.service_s + setup)


def pick(tasks: list[Task], now: float, loaded_job: str | None) -> Task | None:
    """The task a worker holding ``loaded_job``'s model should run next (ties: earliest)."""
    if not tasks:
        return None
    return max(tasks, key=lambda t: (response_ratio(t, now, loaded_job), -t.arrival))


def fcfs_pick(tasks: list[Task], now: float, loaded_job: str | None) -> Task | None:
    """The baseline: arrival order, whatever the worker holds."""
    return min(tasks, key=lambda t: t.arrival) if tasks else None


def run_worker(tasks: list[Task], policy: str = "hrrs", loaded_job: str | None = None) -> dict[str, float]:
    """Serve ``tasks`` on one worker (non-preemptive), as they arrive. Returns the total
    time, time spent swapping models, and the mean response time (finish - arrival)."""
    choosers = {"hrrs": pick, "fcfs": fcfs_pick}
    if policy not in choosers:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(choosers)}")
    chooser = choosers[policy]
    pending = sorted(tasks, key=lambda t: t.arrival)
    now, setup_total, responses = 0.0, 0.0, []
    ready: list[Task] = []
    while pending or ready:
        while pending and pending[0].arrival <= now:
            ready.append(pending.pop(0))
        if not ready:
            now = pending[0].arrival
            continue
        task = chooser(ready, now, loaded_job)
        assert task is not None
        ready.remove(task)
        if loaded_job != task.job:
            now += task.setup_s
            setup_total += task.setup_s
            loaded_job = task.job
        now += task.service_s
        responses.append(now - task.arrival)
    return {
        "makespan_s": now,
        "setup_s": setup_total,
        "mean_response_s": sum(responses) / len(responses) if responses else 0.0,
    }
