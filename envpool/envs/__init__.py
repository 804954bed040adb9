"""Built-in environments, registered in ``envpool.default_registry`` on import.

* ``frozenlake-v1``: text FrozenLake, seeded maps (``size``, ``slippery``).
* ``math-tools-v1``: arithmetic word problems with a ``calculator`` tool.
* ``code-repair-v1``: fix a buggy module until its tests pass (view, edit, run_tests, submit).
* ``latency-v0``: steps that take N(mu, sigma) seconds, slow or failing episodes (benchmarks).

Only specs are registered here; an environment's module is imported by ``make``, so
importing this package stays cheap (the zygote and every container import it).

A change of behaviour gets a new id version (``-v2``): a seed must keep meaning the same
episode for recorded trajectories and for replaying a session on a fresh container.
"""

from envpool.api import EnvSpec, default_registry

_specs: list[EnvSpec] = []

_specs.append(
    default_registry.register(
        "frozenlake-v1",
        entry_point="envpool.envs.frozenlake:FrozenLakeEnv",
        kwargs={"size": 4, "slippery": False},
        max_episode_steps=100,
        deterministic=True,
        description="Text FrozenLake: walk from S to G avoiding holes; actions left/right/up/down.",
    )
)
_specs.append(
    default_registry.register(
        "math-tools-v1",
        entry_point="envpool.envs.math_tools:MathToolsEnv",
        max_episode_steps=10,
        deterministic=True,
        description="Arithmetic word problems; call the calculator tool, then answer 'Answer: N'.",
    )
)
_specs.append(
    default_registry.register(
        "code-repair-v1",
        entry_point="envpool.envs.code_repair:CodeRepairEnv",
        max_episode_steps=30,
        deterministic=True,
        description="Fix a buggy Python module: view, edit (search/replace), run_tests, submit.",
    )
)

_specs.append(
    default_registry.register(
        "latency-v0",
        entry_point="envpool.envs.latency:LatencyEnv",
        max_episode_steps=1000,
        deterministic=True,
        description="Steps that take N(mu, sigma) seconds; slow or failing episodes on demand (benchmarks).",
    )
)
_specs.append(
    default_registry.register(
        "echo-v0",
        entry_point="envpool.envs.echo:EchoEnv",
        deterministic=True,
        description="Echoes the action; 'done' ends the episode. The pool's benchmark target.",
    )
)

#: What every container knows without an image (``envpool.json`` adds to these).
BUILTIN_IDS: frozenset[str] = frozenset(s.id for s in _specs)
