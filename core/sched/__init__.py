"""Rollout scheduling policies, shared by the real LLM proxy and the simulator.

``queueing`` (fcfs, rr, sjf, pps, cmlfq), ``placement`` (least_load, cache_affinity,
presorted_dp), ``resources`` (adaptive model parallelism by simulated annealing),
``multiplex`` (HRRS across jobs), ``horizon`` (cyclic-horizon packing of periodic jobs on
shared nodes, over ``segtree``), ``planner`` (the periodic rollout/train GPU split over an
elastic pool), ``predictor`` (progressive length prediction). ``base`` holds the
``Request`` they decide about.
"""

from core.sched.base import Placement, QueuePolicy, Request
from core.sched.placement import PLACEMENTS, make_placement
from core.sched.queueing import QUEUE_POLICIES, make_queue_policy

__all__ = [
    "PLACEMENTS",
    "QUEUE_POLICIES",
    "Placement",
    "QueuePolicy",
    "Request",
    "make_placement",
    "make_queue_policy",
]
