"""The sections of a job config: one pydantic model per part of the YAML (``engine``,
``envs[i]``, ``rewards.<tag>[j]``, ``trainer``, ``rollout``, ``fabric``, ``envpool``), each
with its own types, bounds and field-level rules.

``core.config.JobConfig`` puts them together and checks the rules that span sections; every
model here forbids unknown keys, and each field's docstring is its reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

# the trainer's section and the models' base live apart, so that the trainer actor imports
# none of the rest (see core.config_trainer); re-exported, the reference is read here still
from core.config_trainer import TRAINERS as TRAINERS
from core.config_trainer import ConfigModel as ConfigModel
from core.config_trainer import TrainerConfig as TrainerConfig
from core.config_trainer import one_of as _known
from core.rollout import engine_defaults
from envpool.images.tiers import TierConfig
from envpool.pool import PoolConfig
from fabric.client import ClientConfig

ENGINES = ("torch", "vllm", "openai")
FABRIC_BACKENDS = ("local", "inproc")


#: A path field of the config, ``~`` expanded. Taken as written, ``run_dir: ~/runs/x`` (or the
#: ``images: {dir: ~/.cache/rl-fabric/images}`` the docs recommend) made a directory named
#: ``~`` in the working directory; ``envs[].image`` expanded it already.
UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]


class PretrainConfig(ConfigModel):
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


class EngineConfig(ConfigModel):
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
    max_restarts: int = Field(engine_defaults.MAX_RESTARTS, ge=0)
    """Times Ray restarts a crashed engine replica; the proxy reloads the latest weights
    into it and re-runs the turns it lost."""
    recover_timeout_s: float = Field(engine_defaults.RECOVER_TIMEOUT_S, gt=0, allow_inf_nan=False)
    """How long the proxy waits for a crashed replica to come back (Ray's restart, the
    model's load, the latest weights) before it leaves the group for good. Raise it for a
    large model whose load takes minutes (vLLM)."""
    swap_timeout_s: float = Field(engine_defaults.SWAP_TIMEOUT_S, gt=0, allow_inf_nan=False)
    """How long a weight update waits for one replica's swap before that replica counts as
    lost (it is recovered in the background, or dropped at ``recover_timeout_s``) and the
    update goes on without it. A swap waits for the turns in flight (vLLM's drain), so keep
    it above the longest turn."""
    rejoin_first_s: float | None = Field(engine_defaults.REJOIN_FIRST_S, gt=0, allow_inf_nan=False)
    """How long after a replica left its group (not back within ``recover_timeout_s``, or
    its reload failed) the proxy first tries it again; the try comes between half of it and
    all of it (jittered: replicas dropped together are not tried together). Each failed try
    doubles the wait, up to ``rejoin_max_s``. ``null``: a dropped replica is never tried
    again (the job runs on with the ones left), and the turns it was left running are
    aborted there at once, best effort (a replica still alive would otherwise generate them
    on, for nobody)."""
    rejoin_max_s: float = Field(engine_defaults.REJOIN_MAX_S, gt=0, allow_inf_nan=False)
    """The longest wait between two tries of a dropped replica."""
    start_timeout_s: float = Field(1800.0, gt=0, allow_inf_nan=False)
    """How long the job waits at its start for its actors to be made (every engine
    replica's model load, the proxy, the trainer's) before it stops with
    ``StartupTimeout`` naming the ones not ready: a constructor that hung, or an actor Ray
    cannot place (resources another job holds), held the start for ever."""
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False)
    """GPUs each replica reserves from Ray (Ray then sets its ``CUDA_VISIBLE_DEVICES``);
    ``None``: for ``vllm`` its ``tensor_parallel_size x pipeline_parallel_size`` (1 by
    default), 0 otherwise. A fraction shares a card, e.g. 0.5 with the trainer's 0.5 on a
    one-GPU machine."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific options: for ``torch`` the ``TinyLM`` shape (``d_model``,
    ``n_layers``, ``n_heads``, ``max_len``, ...) and ``TorchEngineConfig`` fields
    (``max_batch_size``, ``batch_wait_ms``, ``num_threads``), checked here (``JobConfig``
    refuses any other key); passed through to the others: vLLM engine args, ``base_url`` of
    an OpenAI-compatible server."""
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    """Pretraining of a new ``tiny-lm`` (torch backend) before RL; off by default."""

    @property
    def gpus(self) -> float:
        """GPUs per replica (``num_gpus`` or the backend's default)."""
        if self.num_gpus is not None:
            return self.num_gpus
        return float(self.vllm_world_size) if self.backend == "vllm" else 0.0

    @property
    def vllm_world_size(self) -> int:
        """The GPUs one vLLM replica spreads its model over (tensor x pipeline parallel)."""
        size = 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = self.kwargs.get(key, 1)
            size *= value if isinstance(value, int) and value > 0 else 1
        return size

    @model_validator(mode="after")
    def _rejoin_backoff_grows(self) -> EngineConfig:
        # the waits double from rejoin_first_s and stop at rejoin_max_s: a cap below the first
        # wait would make every later try come sooner than the first, surely not what was meant
        first, most = self.rejoin_first_s, self.rejoin_max_s
        if first is not None and most < first:
            raise ValueError(
                f"rejoin_max_s {most:g} is below rejoin_first_s {first:g}: a dropped replica's "
                "tries start rejoin_first_s apart and back off up to rejoin_max_s; raise "
                "rejoin_max_s or lower rejoin_first_s"
            )
        return self

    @model_validator(mode="after")
    def _enough_gpus_for_vllm(self) -> EngineConfig:
        # Ray shows the replica only the GPUs it reserved: vLLM then failed at the first
        # turn ("World size (2) is larger than the number of available GPUs (1)"), and
        # again at every turn, until the job gave up on a streak of failed groups
        world = self.vllm_world_size
        if self.backend == "vllm" and world > 1 and self.num_gpus is not None and self.num_gpus < world:
            raise ValueError(
                f"num_gpus {self.num_gpus:g} is below the {world} GPUs a replica's "
                "tensor_parallel_size x pipeline_parallel_size needs (leave num_gpus unset: it follows them)"
            )
        return self


class PromptConfig(ConfigModel):
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


class EnvConfig(ConfigModel):
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
    image: str | None = Field(None, min_length=1)
    """Where the environment comes from when it is not a built-in: a directory holding its
    files and an ``envpool.json`` (``{"modules": [...]}`` or ``{"register": [...]}``; a
    relative path is taken from the working directory, as ``run_dir`` is), which the job
    builds into an image at start, or a published image reference ``name@sha256:<hex>``
    (found in ``images.dir`` or ``images.tiers``). None: the built-ins."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    actions: list[str] | None = Field(None, min_length=1)
    """Constrain every reply to one of these words (one token each, the engine's
    ``allowed_token_ids``): a closed action space the policy cannot step outside. ``None``:
    free text, parsed by the environment (an unparseable reply is an invalid action, which
    the environment penalises)."""

    @field_validator("image")
    @classmethod
    def _image_dir_absolute(cls, v: str | None) -> str | None:
        # a directory is resolved once, here, against the working directory of the load:
        # the job that builds it later (and the run directory's config.yaml) means the same one
        if v is None or is_image_ref(v):
            return v
        return str(Path(v).expanduser().absolute())


def is_image_ref(image: str) -> bool:
    """``name@sha256:<64 hex>`` or ``sha256:<64 hex>`` (anything else names a directory)."""
    from envpool.images.bundle import ImageRef
    from envpool.images.errors import InvalidImageRef

    try:
        ImageRef.parse(image)
    except InvalidImageRef:
        return False
    return True


class RewardConfig(ConfigModel):
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
    failure_score: float | None = Field(None, allow_inf_nan=False)
    """The component's score when the function fails on this trajectory for good with
    ``UserError`` (it raised) or ``FunctionTimeout`` (it hung, on every attempt): an output
    that crashes or hangs the verifier then costs the policy this (say 0.0) instead of being
    masked (``reward_failed``) and re-run, which never penalises it. Infrastructure failures
    (a lost worker, throttling, an open circuit) always mask, and so does ``Misconfigured``
    (the function's setup is wrong: a judge's key refused, its model unknown, a tool not
    installed), which would fail every trajectory alike. Off by default: a dataset bug
    that makes the function raise on every trajectory would score them all, so watch
    ``failure_scored`` and ``failures`` in the stream's metrics."""

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


class RolloutConfig(ConfigModel):
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
    eval_exact: bool = False
    """Async mode: hold the next weight update until a running evaluation ends, so every
    turn of the row for step ``k`` is played by version ``k`` (costs up to the evaluation's
    time once every ``eval_every`` steps). Off: training publishes on while it runs, and the
    row's ``versions`` says which versions played it."""
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
    engine's own batch setting when a policy is set: torch's ``max_batch_size``, vLLM's
    ``max_num_seqs`` (256 where unset), openai's ``max_concurrency``; no proxy queue with
    fcfs/affinity)."""
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


#: The package of the built-in fabric functions (``env_return``, ``exact_match``, ...).
BUILTIN_FUNCTIONS = "functions"


class FabricConfig(ConfigModel):
    """Where reward and tool functions run."""

    backend: Annotated[Literal["local", "inproc"], _known("fabric backend", FABRIC_BACKENDS)] = "local"
    """``local``: warm worker processes on this machine (the embedded default); ``inproc``:
    in the job's process (debugging, tests)."""
    workers: int | None = Field(None, ge=1)
    """Cap on worker processes per function (``local`` only; default: the CPU count)."""
    discover: list[str] = Field(default_factory=lambda: [BUILTIN_FUNCTIONS])
    """Modules or packages whose fabric functions the job uses (the built-ins by default)."""
    client: ClientConfig = Field(default_factory=ClientConfig)
    """Hedging, circuit breaker, default deadline of the fabric client."""

    def backend_config(self) -> dict[str, Any]:
        """The config ``fabric.Client(backend=...)`` takes."""
        if self.backend == "local" and self.workers is not None:
            return {"type": "local", "max_workers": self.workers}
        return {"type": self.backend}


class CheckpointConfig(ConfigModel):
    """How often the job saves what ``fabric run --resume`` continues from (``<run_dir>/checkpoints``)."""

    every: int = Field(0, ge=0)
    """Steps between checkpoints (and one after the last step); 0: none. Each holds the
    trainer's weights, optimizer moments and KL anchor (a few times the model's size)."""
    keep: int = Field(1, ge=1)
    """The newest checkpoints kept; older ones are removed once a newer one is complete."""


#: The name of the job's own disk tier in its image cache (``core.env_images.open_cache``).
JOB_DISK = "job-disk"


class ImagesConfig(ConfigModel):
    """Where the job keeps the images of its environments (``envs[].image``)."""

    dir: UserPath | None = None
    """The job's image cache: a disk tier of bundles (``<dir>/blobs``) and the bundles
    unpacked for the containers and the tokenizer's corpus (``<dir>/unpacked``). Default:
    ``<run_dir>/images``; share one between runs (``~/.cache/rl-fabric/images``) to build
    and unpack an unchanged directory once for all of them. Relative: to the working
    directory."""
    tiers: list[TierConfig] = Field(default_factory=list)
    """More places to find a published image reference, searched after ``dir``: ``s3``,
    ``mirror``, ``origin`` tiers (``envpool.images.tiers``), e.g.
    ``[{type: origin, url: "http://registry:8080"}]``."""

    @model_validator(mode="after")
    def _tier_names(self) -> ImagesConfig:
        # they key the cache's metrics; the job's own disk tier comes first
        names = [JOB_DISK, *(t.name or t.type for t in self.tiers)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tier names must be unique (give each a name): {', '.join(twice)} twice")
        return self

    def cache_dir(self, run_dir: Path) -> Path:
        return self.dir if self.dir is not None else run_dir / "images"


class EnvPoolConfig(PoolConfig):
    """envpool's ``PoolConfig`` (``runtime: process`` is its shorthand for ``runtime: {type:
    process}``), with its fields' docstrings kept for the job's config reference."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
