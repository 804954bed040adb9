"""``JobConfig``: everything one RL job needs, loaded from YAML and validated once, here.

    cfg = JobConfig.from_yaml("examples/frozenlake/config.yaml")   # ConfigError if anything is off

Validation has two layers, and both report every problem at once, each under the key it
belongs to (``envs[1].id``, ``rewards.frozenlake[0].function``, ``alpha``):

1. **Schema** (pydantic, ``extra="forbid"`` everywhere): types, bounds, unknown keys, unknown
   engine/trainer/fabric backends, and the cross-field rules (every environment tag has
   rewards, every reward tag is used by an environment, weights are not all zero, ...).
2. **References** (``validate_references``): every environment id is registered with
   envpool, every reward is a registered fabric *reward*, and its ``args``/``task_args``
   fit the function's signature. ``from_yaml`` runs it against the registries found by
   discovery (``fabric.discover`` modules and envpool's built-ins); tests pass their own.

Nothing downstream re-validates: the job passes these typed objects inward.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.errors import ConfigError
from envpool.pool import PoolConfig
from fabric.client import ClientConfig
from fabric.registry import Registry

ENGINES = ("torch", "vllm", "openai")
TRAINERS = ("torch", "megatron")
FABRIC_BACKENDS = ("local", "inproc")
#: The key of ``engine.hw_affinity`` that covers every tag not named there.
DEFAULT_AFFINITY = "default"
_SEMANTICS = "job_semantics"  # error type carrying the cross-field problems as a list


def _known(what: str, known: tuple[str, ...]) -> BeforeValidator:
    """A check that names the bad value and the known ones (pydantic's literal error says
    only "Input should be ...")."""

    def check(v: Any) -> Any:
        if isinstance(v, str) and v not in known:
            raise ValueError(f"unknown {what} {v!r}; known: {', '.join(known)}")
        return v

    return BeforeValidator(check)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


# ----------------------------------------------------------------------------- sections


class PretrainConfig(_Model):
    """Self-supervised pretraining of a new ``tiny-lm`` before RL starts.

    An LLM that RL trains has read a lot of text first; a ``tiny-lm`` starts from random
    weights, and must learn to read its prompt from the reward alone: on FrozenLake it sat
    undecided between two moves for 130-400 steps before it learned to look at the tiles
    next to it. Next-token prediction on random play (observation, action, next observation,
    as the policy is shown them) teaches it what a move does first ("right" into an ``H``
    is followed by "You fell into a hole"); RL then only has to prefer what it can read.
    """

    steps: int = Field(0, ge=0)
    """Optimizer steps; 0 = RL starts from the random initialisation."""
    episodes: int = Field(600, ge=1, le=1_000_000)
    """Random-play episodes per environment (seeds 0..episodes-1; the tokenizer is trained on
    them too). At least the tokenizer's 200 are played, whatever this says."""
    batch_size: int = Field(64, ge=1)
    """Transitions per step."""
    lr: float = Field(3e-3, gt=0, allow_inf_nan=False)


class EngineConfig(_Model):
    """The policy's inference engine(s) behind the LLM proxy."""

    backend: Annotated[Literal["torch", "vllm", "openai"], _known("engine", ENGINES)] = "torch"
    """``torch`` (a small causal LM in plain PyTorch, the CPU default), ``vllm`` (GPU) or
    ``openai`` (any OpenAI-compatible server; its URL goes in ``kwargs``)."""
    model: str = Field("tiny-lm", min_length=1)
    """Model name or path, as the backend understands it."""
    replicas: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    """Per generated turn."""
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    hw_affinity: dict[str, str] = Field(default_factory=dict)
    """Environment tag -> Ray custom resource the tag's generation runs on (``default`` for
    every other tag), e.g. ``{frozenlake: H800, default: H20}``."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a crashed engine replica; the proxy reloads the latest weights
    into it and re-runs the turns it lost."""
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False)
    """GPUs each replica reserves from Ray (Ray then sets its ``CUDA_VISIBLE_DEVICES``);
    ``None``: 1 for ``vllm``, 0 otherwise. A fraction shares a card, e.g. 0.5 with the
    trainer's 0.5 on a one-GPU machine."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific options, passed through: for ``torch`` the ``TinyLM`` shape
    (``d_model``, ``n_layers``, ``n_heads``, ``max_len``) and ``TorchEngineConfig`` fields;
    vLLM engine args; ``base_url`` of an OpenAI-compatible server."""
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    """Pretraining of a new ``tiny-lm`` (torch backend) before RL; off by default."""

    @property
    def gpus(self) -> float:
        """GPUs per replica (``num_gpus`` or the backend's default)."""
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if self.backend == "vllm" else 0.0


class PromptConfig(_Model):
    """What the policy is shown each turn (the trajectory itself always keeps everything)."""

    history: int | None = Field(None, ge=0)
    """Earlier (reply, observation) pairs shown before the latest observation; ``None``:
    the whole conversation. An environment whose observation is its whole state (FrozenLake's
    map) learns faster with 0: shorter prompts, nothing stale to attend to."""
    drop_lines: list[str] = Field(default_factory=list)
    """Observation lines starting with one of these are cut from the prompt (a legend that is
    the same every turn carries no information)."""
    system: str | None = None
    """A system message put first."""


class EnvConfig(_Model):
    """One entry of the environment mix."""

    id: str = Field(min_length=1)
    """A registered envpool environment id (``frozenlake-v1``)."""
    tag: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    """Names the entry's rewards (``rewards.<tag>``) and hardware affinity."""
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Share of the groups drawn from this entry (relative to the other entries)."""
    max_turns: int = Field(16, ge=1)
    """Policy turns before the trajectory is truncated."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments of the environment (override the registered ones)."""
    image: str | None = None
    """Image reference of a custom environment bundle (None: the built-ins)."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    actions: list[str] | None = Field(None, min_length=1)
    """Constrain every reply to one of these words (one token each, the engine's
    ``allowed_token_ids``): a closed action space the policy cannot step outside. ``None``:
    free text, parsed by the environment (an unparseable reply is an invalid action, which
    the environment penalises)."""


class RewardConfig(_Model):
    """One weighted component of a tag's reward."""

    function: str = Field(min_length=1)
    """A registered fabric reward function."""
    name: str | None = Field(None, min_length=1)
    """Component name in ``RewardResult.components`` (default: the function's name; set it
    when one function appears twice under a tag)."""
    weight: float = Field(1.0, ge=0, allow_inf_nan=False)
    args: dict[str, Any] = Field(default_factory=dict)
    """Fixed keyword arguments besides the trajectory."""
    task_args: dict[str, str] = Field(default_factory=dict)
    """Keyword arguments read from the trajectory's task: parameter -> key of
    ``Trajectory.task`` (``{ground_truth: answer}``)."""
    deadline_s: float | None = Field(None, gt=0)
    """Deadline of one call, retries included (None: the client's default)."""

    @property
    def component(self) -> str:
        return self.name or self.function

    @model_validator(mode="after")
    def _args_do_not_clash(self) -> RewardConfig:
        if "traj" in self.args or "traj" in self.task_args:
            raise ValueError("'traj' is passed by the reward stream; do not set it in args or task_args")
        both = sorted(set(self.args) & set(self.task_args))
        if both:
            raise ValueError(f"{', '.join(map(repr, both))} set in both args and task_args")
        return self


class TrainerConfig(_Model):
    """GRPO hyper-parameters and the training backend."""

    backend: Annotated[Literal["torch", "megatron"], _known("trainer", TRAINERS)] = "torch"
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    clip_eps: float = Field(0.2, gt=0, allow_inf_nan=False)
    """PPO-style clipping of the probability ratio."""
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the KL penalty to the reference policy (0: no reference model is kept)."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    minibatch_size: int | None = Field(None, ge=1)
    """Trajectories per optimiser step (None: the whole batch)."""
    clip_eps_high: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Upper ratio clip (DAPO's clip-higher); None: ``clip_eps``."""
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=False)
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Bonus on the policy's entropy (keeps a small policy exploring)."""
    lr_end: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Decay the learning rate linearly to this over the job's steps (None: constant)."""
    scale_advantages: bool = True
    """Divide by the group's reward std (GRPO); False keeps the centred reward (Dr. GRPO)."""
    step_adv: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of GiGPO's step-level advantage (turns taken in the same state of the same task,
    compared by discounted return), added to the episode's group advantage; 0: plain GRPO."""
    gamma: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    """Discount of the step-level returns."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific options (Megatron parallelism, ...), passed through."""
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False)
    """GPUs the trainer actor reserves from Ray; ``None``: 1 for ``megatron``, 0 for ``torch``."""

    @property
    def gpus(self) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if self.backend == "megatron" else 0.0


class RolloutConfig(_Model):
    """How the rollout is driven."""

    mode: Literal["async", "sync"] = "async"
    """``async``: trajectory-level: every trajectory runs its own loop, groups keep starting
    while the trainer trains, within ``alpha``. ``sync``: batch-level, for comparison: a
    step's groups start together, every turn waits for the whole batch, training waits for
    the last trajectory."""
    max_groups_in_flight: int | None = Field(None, ge=1)
    """Groups rolling out at once (None: ``batch_size * (alpha + 1)``)."""
    trajectory_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    """A trajectory running longer is aborted as ``infra_failed`` and re-run."""
    max_reruns: int = Field(3, ge=0)
    """Re-runs of a group's failed trajectories before the group is given up."""
    eval_every: int = Field(10, ge=0)
    """Greedy evaluation on held-out tasks every this many steps (0: never)."""
    eval_episodes: int = Field(64, ge=1)
    """Held-out tasks per evaluation (seeds the training draw never uses)."""
    scheduler: Literal["fcfs", "rr", "sjf", "pps", "cmlfq"] = "fcfs"
    """Which waiting turn a replica runs next (``core.sched.queueing``): arrival order,
    step-centric round robin, shortest predicted first, longest predicted first
    (progressive priority), or the causal multi-level feedback queue on tool outcomes."""
    placement: Literal["affinity", "least_load", "cache_affinity", "presorted_dp"] = "affinity"
    """Which replica a trajectory runs on: ``affinity`` keeps it where its first turn ran
    (least turns in flight); the others are ``core.sched.placement`` by predicted work,
    re-decided between turns (``cache_affinity``, ``presorted_dp``)."""
    slots_per_replica: int | None = Field(None, ge=1)
    """Turns a replica runs at once; the rest wait in the scheduler's queue (None: the
    engine's ``max_batch_size`` when a policy is set, no proxy queue with fcfs/affinity)."""
    scheduler_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to the queue policy (e.g. ``{levels: 3, aging_s: 10}`` for cmlfq)."""
    trace: bool = False
    """Write one JSON line per turn to ``<run_dir>/trace.jsonl`` (replayed by ``core.sim``)."""

    @model_validator(mode="after")
    def _options_fit(self) -> RolloutConfig:
        from core.sched import make_queue_policy

        try:
            make_queue_policy(self.scheduler, **self.scheduler_options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"scheduler_options do not fit scheduler {self.scheduler!r}: {e}") from None
        return self


class FabricConfig(_Model):
    """Where reward and tool functions run."""

    backend: Annotated[Literal["local", "inproc"], _known("fabric backend", FABRIC_BACKENDS)] = "local"
    """``local``: warm worker processes on this machine (the embedded default); ``inproc``:
    in the job's process (debugging, tests)."""
    workers: int | None = Field(None, ge=1)
    """Cap on worker processes per function (``local`` only; default: the CPU count)."""
    discover: list[str] = Field(default_factory=lambda: ["functions"])
    """Modules or packages whose fabric functions the job uses (the built-ins by default)."""
    client: ClientConfig = Field(default_factory=ClientConfig)
    """Hedging, circuit breaker, default deadline of the fabric client."""

    def backend_config(self) -> dict[str, Any]:
        """The config ``fabric.Client(backend=...)`` takes."""
        if self.backend == "local" and self.workers is not None:
            return {"type": "local", "max_workers": self.workers}
        return {"type": self.backend}


class EnvPoolConfig(PoolConfig):
    """envpool's ``PoolConfig``, with ``runtime: process`` accepted as a shorthand for
    ``runtime: {type: process}``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    @field_validator("runtime", mode="before")
    @classmethod
    def _runtime_shorthand(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v


# ----------------------------------------------------------------------------- the job


class JobConfig(_Model):
    """One RL job: the policy engine, the environment mix and its rewards, the GRPO batch
    shape, the asynchronous bound, the trainer and where functions and environments run."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    envs: list[EnvConfig] = Field(min_length=1)
    rewards: dict[str, list[RewardConfig]] = Field(default_factory=dict)
    """Environment tag -> the weighted reward components of its trajectories."""
    batch_size: int = Field(8, ge=1)
    """Groups per training step."""
    group_size: int = Field(8, ge=2)
    """Trajectories per group (GRPO normalises rewards within a group, so at least 2)."""
    redundancy: int = Field(0, ge=0)
    """Extra rollouts started per group; the slowest are aborted once ``group_size`` finished."""
    alpha: int = Field(1, ge=0)
    """Asynchronous bound: a trajectory started under policy version ``v`` is dropped once the
    trainer publishes a version above ``v + alpha`` (0: fully on-policy)."""
    steps: int = Field(100, ge=1)
    """Training steps of the job."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    fabric: FabricConfig = Field(default_factory=FabricConfig)
    envpool: EnvPoolConfig = Field(default_factory=EnvPoolConfig)
    run_dir: Path = Path("runs/job")
    """Where metrics, plots and the summary go (relative paths: to the working directory)."""
    seed: int = 0

    # -- cross-field rules: collected, so every one of them is reported at once
    @model_validator(mode="after")
    def _semantics(self) -> JobConfig:
        problems = self.semantic_problems()
        if problems:
            raise PydanticCustomError(
                _SEMANTICS, "{count} problems", {"count": len(problems), "problems": problems}
            )
        return self

    def semantic_problems(self) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        tags = {e.tag for e in self.envs}
        for i, env in enumerate(self.envs):
            if env.tag not in self.rewards and env.tag not in {e.tag for e in self.envs[:i]}:
                problems.append(
                    (f"envs[{i}].tag", f"tag {env.tag!r} has no rewards; add a 'rewards.{env.tag}' list")
                )
        for tag, specs in self.rewards.items():
            if tag not in tags:
                problems.append((f"rewards.{tag}", f"no environment has tag {tag!r}; tags: {_list(tags)}"))
            if not specs:
                problems.append((f"rewards.{tag}", "needs at least one reward function"))
                continue
            seen: set[str] = set()
            for j, spec in enumerate(specs):
                if spec.component in seen:
                    problems.append(
                        (
                            f"rewards.{tag}[{j}].name",
                            f"component {spec.component!r} appears twice; give each a distinct name",
                        )
                    )
                seen.add(spec.component)
            if not any(s.weight > 0 for s in specs):
                problems.append((f"rewards.{tag}", "all weights are zero; at least one component must count"))
        if self.engine.pretrain.steps and (self.engine.backend != "torch" or self.engine.model != "tiny-lm"):
            problems.append(
                (
                    "engine.pretrain.steps",
                    "pretraining builds a new tiny-lm (engine.backend: torch, engine.model: tiny-lm); "
                    f"this engine is {self.engine.backend} {self.engine.model!r}: set steps to 0",
                )
            )
        problems += self._trainer_engine_problems()
        for tag in self.engine.hw_affinity:
            if tag != DEFAULT_AFFINITY and tag not in tags:
                problems.append(
                    (
                        f"engine.hw_affinity.{tag}",
                        f"no environment has tag {tag!r}; tags: {_list(tags)} (or '{DEFAULT_AFFINITY}')",
                    )
                )
        rollouts = self.batch_size * self.group_size
        mb = self.trainer.minibatch_size
        if mb is not None and mb > rollouts:
            problems.append(
                (
                    "trainer.minibatch_size",
                    f"{mb} is more than the {rollouts} trajectories of a batch (batch_size * group_size)",
                )
            )
        return problems

    def _trainer_engine_problems(self) -> list[tuple[str, str]]:
        """The trainer must train the policy the engine serves, under names it can load."""
        trainer, engine = self.trainer.backend, self.engine.backend
        if trainer == "torch" and engine != "torch":
            return [
                (
                    "trainer.backend",
                    f"the torch trainer trains the torch engine's tiny-lm; with engine.backend {engine} use "
                    "trainer.backend: megatron (trainer.kwargs.hf_model: the checkpoint the engine serves)",
                )
            ]
        if trainer == "megatron" and engine == "torch":
            return [
                (
                    "trainer.backend",
                    "megatron trains a Hugging Face model for the vllm engine; the torch engine's "
                    "tiny-lm is trained by trainer.backend: torch",
                )
            ]
        if (
            trainer == "megatron"
            and engine == "vllm"
            and not {"hf_model", "checkpoint"} & set(self.trainer.kwargs)
        ):
            return [
                (
                    "trainer.kwargs.hf_model",
                    "vLLM loads weights under Hugging Face names: start the megatron trainer from the "
                    f"checkpoint the engine serves (engine.model {self.engine.model!r}; a local directory)",
                )
            ]
        return []

    # -- references: the registries are the caller's, so tests can pass fresh ones
    def validate_references(self, registry: Registry, env_ids: Iterable[str]) -> None:
        """Raise ``ConfigError`` listing every environment id that is not registered and every
        reward that is not a registered reward or whose arguments do not fit it."""
        problems = self.reference_problems(registry, env_ids)
        if problems:
            raise ConfigError(problems)

    def reference_problems(self, registry: Registry, env_ids: Iterable[str]) -> list[tuple[str, str]]:
        known_envs = sorted(env_ids)
        rewards = sorted(s.name for s in registry.specs() if s.kind == "reward")
        problems: list[tuple[str, str]] = []
        for i, env in enumerate(self.envs):
            if env.id not in known_envs:
                hint = _hint(env.id, known_envs)
                msg = f"unknown environment {env.id!r}{hint}; registered: {_list(known_envs)}"
                problems.append((f"envs[{i}].id", msg))
        for tag, specs in self.rewards.items():
            for j, spec in enumerate(specs):
                key = f"rewards.{tag}[{j}]"
                if spec.function not in registry:
                    msg = (
                        f"unknown reward {spec.function!r}{_hint(spec.function, rewards)}; "
                        f"registered: {_list(rewards)}"
                    )
                    problems.append((f"{key}.function", msg))
                    continue
                fn = registry.get(spec.function)
                if fn.kind != "reward":
                    problems.append(
                        (
                            f"{key}.function",
                            f"{spec.function!r} is a {fn.kind}, not a reward; rewards: {_list(rewards)}",
                        )
                    )
                    continue
                # the stream calls fn(traj=..., **args, **task_args): check that shape now, not per call
                shape = dict.fromkeys(["traj", *spec.args, *spec.task_args])
                problem = fn.check_args(shape)
                if problem is not None:
                    problems.append((f"{key}.args", problem))
        return problems

    # -- loading
    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        source: str | None = None,
        registry: Registry | None = None,
        env_ids: Iterable[str] | None = None,
        check_references: bool = True,
    ) -> JobConfig:
        """Validate ``data``; with ``check_references`` also the environment ids and reward
        names (against ``registry``/``env_ids``, or what discovery finds when not given)."""
        if not isinstance(data, dict):
            raise ConfigError([("", f"a job config is a mapping of keys, got {type(data).__name__}")], source)
        try:
            cfg = cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_problems(e), source) from None
        if check_references:
            if registry is None:
                registry = cfg.discover_functions(source)
            if env_ids is None:
                env_ids = registered_env_ids()
            problems = cfg.reference_problems(registry, env_ids)
            if problems:
                raise ConfigError(problems, source)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, **kw: Any) -> JobConfig:
        """Load and validate a YAML job config (see ``from_dict`` for the keywords)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError([("", f"cannot read the config: {e.strerror or e}")], str(path)) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError([("", f"not valid YAML: {e}")], str(path)) from None
        return cls.from_dict({} if data is None else data, source=str(path), **kw)

    def to_yaml(self) -> str:
        """The config with every default filled in (what a run directory records)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def discover_functions(self, source: str | None = None) -> Registry:
        """A fresh registry holding the functions of the ``fabric.discover`` modules."""
        from fabric.errors import RegistryError

        registry = Registry()
        for i, target in enumerate(self.fabric.discover):
            try:
                registry.discover(target)
            except RegistryError as e:
                raise ConfigError([(f"fabric.discover[{i}]", str(e))], source) from None
        return registry


def registered_env_ids() -> list[str]:
    """Ids in envpool's default registry, the built-ins included."""
    import envpool
    import envpool.envs  # registers the built-in environments

    return envpool.default_registry.ids()


# ----------------------------------------------------------------------------- messages


def _list(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "(none)"


def _hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model at ``loc`` (for "unknown key" messages); [] if unknown."""
    ann: Any = JobConfig
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            ann = field.annotation
        elif get_origin(ann) is list:
            ann = get_args(ann)[0]
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        else:
            return []
    ann = _unwrap(ann)
    return list(ann.model_fields) if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def _unwrap(ann: Any) -> Any:
    """``M`` for ``Annotated[M, ...]`` and ``M | None``."""
    if get_origin(ann) is Annotated:
        return _unwrap(get_args(ann)[0])
    if get_origin(ann) in (Union, UnionType):
        models = [a for a in get_args(ann) if a is not type(None)]
        return _unwrap(models[0]) if len(models) == 1 else ann
    return ann


def _problems(e: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in e.errors(include_url=False):
        loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
        if kind == _SEMANTICS:
            problems.extend(ctx["problems"])
            continue
        if kind == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            msg = "unknown key" + (
                f"{_hint(str(loc[-1]), allowed)}; allowed: {', '.join(allowed)}" if allowed else ""
            )
        elif kind == "missing":
            msg = "required key is missing"
        elif kind in _BOUNDS:
            op, name = _BOUNDS[kind]
            msg = f"must be {op} {ctx[name]} (got {err['input']!r})"
        elif kind == "value_error":
            msg = str(ctx.get("error", err["msg"]))
        else:
            shown = err["input"]
            got = "" if isinstance(shown, dict | list) else f" (got {shown!r})"
            msg = f"{err['msg']}{got}"
        problems.append((_key(loc), msg))
    return problems


_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
