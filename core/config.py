"""``JobConfig``: everything one RL job needs, loaded from YAML and validated once, here.

    cfg = JobConfig.from_yaml("examples/frozenlake/config.yaml")   # ConfigError if anything is off

Validation has two layers, and both report every problem at once, each under the key it
belongs to (``envs[1].id``, ``rewards.frozenlake[0].function``, ``alpha``):

1. **Schema** (pydantic, ``extra="forbid"`` everywhere): types, bounds, unknown keys, unknown
   engine/trainer/fabric backends, and the cross-field rules (every environment tag has
   rewards, every reward tag is used by an environment, weights are not all zero, ...).
2. **References** (``validate_references``): every environment id is a built-in or
   registered by its entry's ``image`` (a directory with an ``envpool.json``, or a published
   reference: ``core.env_images``), every reward is a registered fabric *reward*, its
   ``args``/``task_args`` fit the function's signature and its fixed ``args`` values are of
   the parameters' types (``core.config_rewards``: checked as the reward's worker checks a
   call; a built-in left out of ``fabric.discover`` is named as such). ``from_yaml`` runs it
   against the registries found by discovery (``fabric.discover`` modules and envpool's
   built-ins); tests pass their own. An environment registered only by a ``fabric.discover``
   module is refused with the ``image`` line that makes it work: no container or corpus
   child imports those.

Nothing downstream re-validates: the job passes these typed objects inward.

The sections' models live in ``core.config_sections`` (the trainer's in
``core.config_trainer``, which the trainer actor imports alone) and the wording of the
problems in ``core.config_messages``; every section model is importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from core.config_backends import torch_engine_problems, trainer_problems
from core.config_messages import listing, semantic_error, validation_problems
from core.config_rewards import reward_problems
from core.config_sections import (
    ENGINES,
    FABRIC_BACKENDS,
    TRAINERS,
    CheckpointConfig,
    ConfigModel,
    EngineConfig,
    EnvConfig,
    EnvPoolConfig,
    FabricConfig,
    ImagesConfig,
    PretrainConfig,
    PromptConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    UserPath,
)
from core.entropy_control import entropy_target_problem
from core.errors import ConfigError
from core.rollout.engine_defaults import DEFAULT_AFFINITY
from fabric.config_messages import yaml_problem
from fabric.registry import Registry

__all__ = [
    "DEFAULT_AFFINITY",
    "ENGINES",
    "FABRIC_BACKENDS",
    "TRAINERS",
    "CheckpointConfig",
    "EngineConfig",
    "EnvConfig",
    "EnvPoolConfig",
    "FabricConfig",
    "ImagesConfig",
    "JobConfig",
    "PretrainConfig",
    "PromptConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "builtin_env_ids",
    "registered_env_ids",
]


class JobConfig(ConfigModel):
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
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run_dir: UserPath = Path("runs/job")
    """Where metrics, plots and the summary go (relative paths: to the working directory)."""
    seed: int = 0

    # -- cross-field rules: collected, so every one of them is reported at once
    @model_validator(mode="after")
    def _semantics(self) -> JobConfig:
        problems = self.semantic_problems()
        if problems:
            raise semantic_error(problems)
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
                problems.append((f"rewards.{tag}", f"no environment has tag {tag!r}; tags: {listing(tags)}"))
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
        mismatch = self._trainer_engine_problems()
        problems += mismatch
        # the backends' own settings: refused here, not dropped (engine.kwargs) or found by the
        # trainer actor after the policy was built and Ray started (trainer.kwargs); a trainer
        # that does not fit the engine is fixed first (its kwargs would change with it)
        problems += torch_engine_problems(self.engine)
        if not mismatch:
            problems += trainer_problems(self.trainer, temperature=self.engine.temperature, seed=self.seed)
        for tag in self.engine.hw_affinity:
            if tag != DEFAULT_AFFINITY and tag not in tags:
                problems.append(
                    (
                        f"engine.hw_affinity.{tag}",
                        f"no environment has tag {tag!r}; tags: {listing(tags)} (or '{DEFAULT_AFFINITY}')",
                    )
                )
        problems += self._entropy_target_problems()
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

    @property
    def env_return_shares(self) -> dict[str, float]:
        """Tag -> ``env_return``'s share of the tag's score: the weight of its ``env_return``
        components over the weight of all of them. The reward stream of the job scores a
        trajectory the weighted mean of its components (``combine``, normalised, nothing
        clipped), so the score is exactly ``share * env_return + the rest``; GiGPO's step
        rewards keep the per-turn credit of that share (``build_batch``). 1 for a tag scored
        by ``env_return`` alone (components of weight 0 aside: they add nothing), 0 without
        it. A ``composite`` reward holding ``env_return`` counts as another component: its
        part of the score is credited at the last turn. (``RewardStream(normalize=False)``,
        a weighted sum, would make the share env_return's weight itself; the job does not
        build one.)"""
        shares: dict[str, float] = {}
        for tag, specs in self.rewards.items():
            total = sum(s.weight for s in specs)
            env = sum(s.weight for s in specs if s.function == "env_return")
            # env == total exactly when the others weigh 0 (adding 0.0 is exact): share 1.0
            shares[tag] = env / total if total > 0 else 0.0
        return shares

    def _entropy_target_problems(self) -> list[tuple[str, str]]:
        """A target no reply can reach: when every environment constrains its replies to
        ``actions`` (one token each), a trained token has at most the most actions to choose
        from, and at most ``ln`` of that many nats of entropy. (A free-text reply is bounded
        by the vocabulary, known to the trainer once the policy is built.) With a mix of action
        counts the batch's mean entropy is at most the mean of ``ln(n)`` over its trained
        tokens, below ``ln`` of the widest; but the tokens' shares come from the episodes'
        lengths as much as from ``envs[].weight`` (a 16-turn episode of 4 actions against a
        1-turn one of 2), unknown here: ``ln`` of the widest is the one bound that refuses no
        reachable target. The trainer measures the batch's own (``entropy_max``) and warns."""
        if self.trainer.entropy_target is None or any(e.actions is None for e in self.envs):
            return []
        widest = max(range(len(self.envs)), key=lambda i: len(set(self.envs[i].actions or ())))
        n = len(set(self.envs[widest].actions or ()))
        what = f"a reply constrained to {n} action{'s' if n != 1 else ''} (envs[{widest}].actions)"
        problem = entropy_target_problem(self.trainer.entropy_target, n, what)
        return [("trainer.entropy_target", problem)] if problem else []

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
        """``env_ids``: the environments every container knows without an image (the
        built-ins); an entry's ``image`` adds what it registers (``core.env_images``: its
        directory or reference checked, its modules loaded in a child process)."""
        from core.env_images import image_problems

        builtin = set(env_ids)
        in_driver = set(registered_env_ids()) - builtin_env_ids()
        problems = image_problems(self.envs, self.images, self.run_dir, builtin, in_driver=in_driver)
        return problems + reward_problems(self.rewards, registry, self.fabric.discover)

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
            raise ConfigError(validation_problems(e, cls), source) from None
        if check_references:
            if registry is None:
                registry = cfg.discover_functions(source)
            if env_ids is None:
                env_ids = builtin_env_ids()
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
        except FileNotFoundError:
            where = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
            why = (
                f"cannot read the config: no such file{where}; a config to start from: "
                "examples/frozenlake/config.yaml in the rl-fabric repository"
            )
            raise ConfigError([("", why)], str(path)) from None
        except OSError as e:
            raise ConfigError([("", f"cannot read the config: {e.strerror or e}")], str(path)) from None
        except UnicodeDecodeError:  # a binary, or UTF-16 from an editor: was a traceback
            why = "cannot read the config: not UTF-8 text (save it as UTF-8)"
            raise ConfigError([("", why)], str(path)) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError([("", f"not valid YAML: {yaml_problem(e)}")], str(path)) from None
        except RecursionError:  # the parser's, on flow collections thousands deep: a traceback
            raise ConfigError([("", "not valid YAML: nested too deeply")], str(path)) from None
        if data is None:  # no document, or comments only: "envs: required key is missing" misled
            raise ConfigError([("", EMPTY_CONFIG)], str(path))
        return cls.from_dict(data, source=str(path), **kw)

    def to_yaml(self) -> str:
        """The config with every default filled in (what a run directory records)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def discover_functions(self, source: str | None = None) -> Registry:
        """A fresh registry holding the functions of the ``fabric.discover`` modules."""
        from fabric.errors import RegistryError

        registry = Registry()
        for i, target in enumerate(self.fabric.discover):
            try:
                # one of no functions is warned of (once: the job discovers them again)
                registry.discover_yours(target)
            except RegistryError as e:
                raise ConfigError([(f"fabric.discover[{i}]", str(e))], source) from None
        return registry


#: What an empty config file is told: the least a job needs, and where a whole config is
EMPTY_CONFIG = (
    "the file is empty; a job config needs at least its environments and their rewards: "
    "`envs: [{id: frozenlake-v1, tag: frozenlake}]` and `rewards: {frozenlake: [{function: env_return}]}` "
    "(examples/frozenlake/config.yaml is a whole one; docs/job.md lists every key)"
)


def registered_env_ids() -> list[str]:
    """Ids in envpool's default registry: the built-ins, and what this process registered
    (a ``fabric.discover`` module that calls ``envpool.register``)."""
    import envpool
    import envpool.envs  # registers the built-in environments

    return envpool.default_registry.ids()


def builtin_env_ids() -> set[str]:
    """The environments every container knows without an image."""
    from envpool.envs import BUILTIN_IDS

    return set(BUILTIN_IDS)
