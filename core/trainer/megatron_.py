"""``MegatronTrainer``: GRPO on a megatron-core ``GPTModel``, for the GPU path.

    trainer = trainer_registry.create("megatron", config=MegatronTrainerConfig(
        model=GPTShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64,
                       max_sequence_length=128)))
    metrics = trainer.step(batch)          # same metric keys as the torch backend
    update = trainer.publish()             # fp32 CPU tensors, megatron's state_dict names

    # or the model a vLLM engine serves, published under Hugging Face names:
    MegatronTrainerConfig(hf_model="/models/Qwen2.5-0.5B-Instruct", bf16=True)

The model is built from megatron-core's local layer spec (``get_gpt_layer_local_spec``: no
TransformerEngine, no apex, no compiled kernels), so the only requirements are
megatron-core, PyTorch and one CUDA device. megatron-core and CUDA are imported lazily: this
module imports without them, and constructing the trainer without them raises a
``TrainerError`` that says what to install.

A ``step(batch)`` has the torch backend's shape: the batch is shuffled (seeded) into
mini-batches, one optimizer update per mini-batch, ``epochs`` times over. Each mini-batch is
cut into micro-batches of ``micro_batch_size`` samples whose gradients accumulate, weighted
so the update equals one pass over the whole mini-batch (``loss_agg`` holds across
micro-batches). The loss is ``core.trainer.grpo``'s clipped-ratio surrogate on the completion
tokens, with the sampler's ``allowed_token_ids`` restriction applied to the logits first.

Choices, and why:

* **Optimizer: plain ``torch.optim.AdamW``** on fp32 parameters. megatron-core's optimizer
  wants the model wrapped in its DDP (contiguous grad buffers, ``main_grad``), picks
  TransformerEngine's or apex's fused Adam when present (falling back to this same AdamW), and
  its builder's signature changes between releases; with one data-parallel rank it adds
  nothing but coupling. Gradient clipping is done here, over the tensor-parallel group.
* **bf16 = autocast**: parameters (the master weights) stay fp32 and the forward runs under
  ``torch.autocast(bfloat16)``, megatron-core's own ``enable_autocast`` path. AdamW on bf16
  parameters would lose small updates; ``state()`` is fp32 either way.
* **No dropout**: the trainer's logprobs must be the sampler's (the ratio starts at 1).
* **A Hugging Face checkpoint** (``hf_model``: Llama, Qwen2, Mistral): the model is built as
  that architecture (RMSNorm, SwiGLU, RoPE, grouped-query attention) and loaded through
  ``core.trainer.hf_gpt``'s name mapping, and ``state()`` maps back, so the weights published
  to a vLLM engine serving the same checkpoint carry the names its ``load_weights`` expects.
* **Parallelism**: ``tensor_parallel_size`` / ``pipeline_parallel_size`` are validated and
  passed to ``parallel_state`` and the ``TransformerConfig``. Only 1 x 1 is exercised end to
  end (one process, one GPU). Tensor parallelism under ``torchrun`` is wired but has never
  run on GPUs: the output layer keeps each rank's vocabulary columns
  (``parallel_output=True``, not the full ``[B, T, V]`` logits gathered on every rank), the
  logprobs and entropy of the policy, the reference and ``logprobs()`` come from the shards
  (``core.trainer.lean_logprobs_tp``, its math tested on CPU processes over gloo), the grad
  norm is reduced over the TP group and ``state()`` is this rank's shard. The vocabulary is
  not padded (``check_parallel_shape`` requires ``vocab_size`` divisible by the TP size), so
  every column is a real id, as at tp = 1. At tp = 1 the path is the one every GPU run took
  (``parallel_output=False``, ``lean_logprobs``). A step with pipeline parallelism raises: it
  needs megatron's pipeline schedule, which is not wired in. ``save_checkpoint`` writes one
  file per rank, named with its tp and pp rank (``core.trainer.megatron_checkpoint``); a
  single-GPU checkpoint keeps the one name it is given.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# torch-free, so the job config checks trainer.kwargs before anything starts; re-exported here
from core.config_megatron import GPTShape as GPTShape
from core.config_megatron import MegatronTrainerConfig as MegatronTrainerConfig
from core.config_megatron import check_parallel_shape as check_parallel_shape
from core.entropy_control import EntropyControl, entropy_target_problem
from core.trainer.base import (
    NonFiniteGradient,
    Trainer,
    TrainerError,
    TrainSample,
    load_module_training_state,
    module_training_state,
)
from core.trainer.grpo import aggregate, kl_k3, policy_loss
from core.trainer.hf_gpt import HFArch, hf_to_megatron, megatron_to_hf, read_hf_state
from core.trainer.lean_logprobs import logprobs_and_entropy
from core.trainer.lean_logprobs_tp import vocab_parallel_logprobs_and_entropy
from core.trainer.megatron_batch import Packed, pack_samples
from core.trainer.megatron_checkpoint import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT
from core.trainer.megatron_checkpoint import (
    check_layout,
    layout_fields,
    own_shard_file,
    read_checkpoint,
    shard_file,
)

INSTALL_HINT = "install the megatron extra (pip install -e .[megatron]) on a GPU machine"


def _require_runtime() -> None:
    """megatron-core first (the fix is an install), then a CUDA device."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise TrainerError(f"the megatron trainer needs megatron-core: {INSTALL_HINT} ({e})") from e
    if not torch.cuda.is_available():
        raise TrainerError(
            "no CUDA device: the megatron trainer runs on an NVIDIA GPU "
            "(torch.cuda.is_available() is False); use the 'torch' trainer on a CPU"
        )


def launched_by_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this process is one rank of a world a launcher set up. WORLD_SIZE and
    MASTER_ADDR alone are not enough: a Kubeflow PyTorchJob or a SLURM script exports them
    for the whole pod, and a trainer actor Ray starts there inherits them; taken as
    torchrun's, it waited in init_process_group for ranks that never come. torchrun sets
    TORCHELASTIC_RUN_ID, and every launcher a LOCAL_RANK and a RANK per process."""
    if "TORCHELASTIC_RUN_ID" in env:
        return True
    return all(k in env for k in ("WORLD_SIZE", "MASTER_ADDR", "RANK", "LOCAL_RANK"))


def _init_distributed(tp: int, pp: int) -> None:
    """One process on one GPU unless a launcher (torchrun) set up a bigger world; then
    megatron-core's model-parallel groups, unless someone already made them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if launched_by_torchrun(os.environ):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            if tp * pp > 1:
                raise TrainerError(
                    f"tensor_parallel_size * pipeline_parallel_size = {tp * pp} needs as many "
                    f"processes (launch with torchrun --nproc-per-node {tp * pp}); this one is alone"
                )
            # an in-process store: a world of one needs no port and no rendezvous
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise TrainerError(f"world size {world} is not divisible by tensor x pipeline parallel = {tp * pp}")
    if world != tp * pp:
        # initialize_model_parallel would make the rest data-parallel replicas, and nothing
        # here all-reduces their gradients (no megatron DDP, no finalize_model_grads): each
        # would step on its own batch's gradients and the weights drift apart unseen
        raise TrainerError(
            f"world size {world} is {world // (tp * pp)} data-parallel replicas of tp x pp = {tp} x {pp}; "
            "the megatron trainer has no data parallelism (its gradients are not all-reduced over "
            f"replicas): launch tp x pp = {tp * pp} processes"
        )
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp, pp):
            raise TrainerError(
                f"megatron model parallelism is already initialised as tp x pp = {have[0]} x {have[1]}, "
                f"this trainer asks for {tp} x {pp}"
            )
        return
    kwargs: dict[str, Any] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    if "create_gloo_process_groups" in inspect.signature(parallel_state.initialize_model_parallel).parameters:
        kwargs["create_gloo_process_groups"] = False  # only megatron's distributed optimizer uses them
    parallel_state.initialize_model_parallel(**kwargs)


def _build_gpt(shape: GPTShape | HFArch, cfg: MegatronTrainerConfig) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch: dict[str, Any] = {}
    model_arch: dict[str, Any] = {
        "share_embeddings_and_output_weights": False,
        "position_embedding_type": "learned_absolute",
    }
    spec_args: dict[str, Any] = {}
    if isinstance(shape, HFArch):
        arch, model_arch = shape.transformer_config_args(), shape.gpt_model_args()
        if _local_spec_takes(gpt_layer_specs, "normalization"):
            spec_args["normalization"] = "RMSNorm"
    tconfig = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        pipeline_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # plain PyTorch kernels: the local spec must not need apex or compiled extensions
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        **arch,
    )
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=gpt_layer_specs.get_gpt_layer_local_spec(**spec_args),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # TP = 1: the full vocabulary, as every GPU run so far. TP > 1: each rank keeps its own
        # vocabulary columns (no [B, T, V] gathered on every rank) and the loss combines the
        # shards (lean_logprobs_tp); NOT YET RUN on GPUs
        parallel_output=cfg.tensor_parallel_size > 1,
        **model_arch,
    )
    return model.cuda(torch.cuda.current_device())


def _local_spec_takes(specs: Any, name: str) -> bool:
    """Whether this megatron-core's ``get_gpt_layer_local_spec`` takes the keyword ``name``. In
    0.19.2 it is ``(*args, **kwargs)``, handed on to ``get_gpt_layer_local_submodules``, whose
    signature is the one to read. Without ``normalization="RMSNorm"`` the spec's norm is apex's
    FusedLayerNorm wherever apex is installed (NVIDIA's PyTorch images): it refuses RMSNorm.
    (The block's final norm is not the spec's: TransformerEngine's where it is installed, else
    apex's, else torch's; apex without TransformerEngine refuses RMSNorm there. Not run.)"""
    params = inspect.signature(specs.get_gpt_layer_local_spec).parameters
    if name in params:
        return True
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    inner = getattr(specs, "get_gpt_layer_local_submodules", None)
    return forwards and inner is not None and name in inspect.signature(inner).parameters


def _parallel_ranks() -> tuple[int, int]:
    """This process's tensor and pipeline model-parallel rank (0, 0 on one GPU)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )


def _vocab_range(vocab_size: int) -> tuple[int, int] | None:
    """This rank's columns ``[first, last)`` of the vocabulary when the output layer is split
    over tp > 1 ranks (megatron's own split: contiguous, rank r's the r-th of tp equal parts);
    None at tp = 1, where the logits are whole."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.utils import VocabUtility

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return None
    first, last = VocabUtility.vocab_range_from_global_vocab_size(
        vocab_size, parallel_state.get_tensor_model_parallel_rank(), tp
    )
    return int(first), int(last)


class MegatronTrainer(Trainer):
    name = "megatron"
    config: MegatronTrainerConfig

    def __init__(
        self,
        config: MegatronTrainerConfig | Mapping[str, Any],
        *,
        version: int | None = None,
    ) -> None:
        if not isinstance(config, MegatronTrainerConfig):
            config = MegatronTrainerConfig.model_validate(config)
        _require_runtime()
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        # first: which file of a sharded checkpoint is this process's is known from its ranks
        _init_distributed(tp, pp)
        ckpt: dict[str, Any] | None = None
        if config.checkpoint is not None:
            file = own_shard_file(config.checkpoint, tp, pp, *_parallel_ranks())
            ckpt = read_checkpoint(file)
            check_layout(ckpt, f"checkpoint {file}", tp, pp, *_parallel_ranks())
        shape: GPTShape | HFArch | None = config.model
        hf_state: dict[str, Tensor] | None = None
        if config.hf_model is not None:
            shape = HFArch.from_dir(config.hf_model)
            hf_state = hf_to_megatron(read_hf_state(config.hf_model), shape)
            try:
                check_parallel_shape(shape, config.tensor_parallel_size, config.pipeline_parallel_size)
            except ValueError as e:
                raise TrainerError(f"{config.hf_model}: {e}") from None
        if ckpt is not None:
            shape = (
                HFArch.from_config(ckpt["hf_config"], source=str(config.checkpoint))
                if "hf_config" in ckpt
                else GPTShape.model_validate(ckpt["model"])
            )
            try:
                check_parallel_shape(shape, config.tensor_parallel_size, config.pipeline_parallel_size)
            except ValueError as e:
                raise TrainerError(f"checkpoint {config.checkpoint}: {e}") from None
            if version is None:
                version = int(ckpt["version"])
        assert shape is not None  # the config's validator requires a shape or a checkpoint
        # the config checked a shape it was given; a checkpoint's or hf_model's is known now
        problem = entropy_target_problem(config.entropy_target, shape.vocab_size, "a token of this model")
        if problem:
            raise TrainerError(problem)
        super().__init__(
            version=version or 0,
            adv_eps=config.adv_eps,
            scale_advantages=config.scale_advantages,
            entropy=EntropyControl.from_config(config),
            vocab_size=shape.vocab_size,
            loss_agg=config.loss_agg,
        )
        self.config = config
        self.shape = shape

        from megatron.core import parallel_state, tensor_parallel

        self._parallel_state = parallel_state
        self._not_duplicate = tensor_parallel.param_is_not_tensor_parallel_duplicate
        torch.manual_seed(config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._vocab_range = _vocab_range(shape.vocab_size)
        self.model = _build_gpt(shape, config)
        if ckpt is not None:
            self._load(ckpt["state"], str(config.checkpoint))
        if hf_state is not None:
            self._load(hf_state, str(config.hf_model))
        self.model.train()
        self.reference: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.reference = _build_gpt(shape, config)
            self.reference.load_state_dict(self.model.state_dict())
            self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self._shuffle = torch.Generator().manual_seed(config.seed)

    # -- public helpers -------------------------------------------------------------------

    def state(self) -> dict[str, Tensor]:
        """This rank's weights (the whole model at tp = pp = 1), fp32 copies on the CPU,
        under Hugging Face names when the model came from ``hf_model``. Non-tensor entries
        (``_extra_state``) are left out: an engine loads tensors."""
        own = self._own_state()
        return megatron_to_hf(own, self.shape) if isinstance(self.shape, HFArch) else own

    def _own_state(self) -> dict[str, Tensor]:
        """The weights under megatron-core's names (what a checkpoint holds)."""
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in self.model.state_dict().items()
            if isinstance(v, Tensor)
        }

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], allowed_token_ids: list[int] | None = None
    ) -> list[float]:
        """Per completion token, its logprob under the current weights (as the engine that
        samples from them reports it): for checks and for tests."""
        probe = TrainSample(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            old_logprobs=[0.0] * len(completion_ids),
            advantage=0.0,
            group_id="-",
            policy_version=0,
            allowed_token_ids=allowed_token_ids,
        )
        self.model.eval()
        try:
            packed = self._pack([probe])
            logp, _ = self._logprobs_and_entropy(self.model, packed)
        finally:
            self.model.train()
        return [float(x) for x in logp[0, : len(completion_ids)].cpu()]

    def _training_state(self) -> dict[str, Any]:
        # each rank's state is its own shard: say whose, so it is not resumed by another rank
        return {
            **module_training_state(self.model, self.optimizer, self.reference, self._shuffle),
            **layout_fields(*self._layout()),
        }

    def _load_training_state(self, state: Mapping[str, Any]) -> None:
        check_layout(state, "the training state", *self._layout())
        load_module_training_state(
            state, self.model, self.optimizer, self.reference, self._shuffle, config=self.config
        )

    def _layout(self) -> tuple[int, int, int, int]:
        """tp, pp and this process's tensor and pipeline rank."""
        return self.config.tensor_parallel_size, self.config.pipeline_parallel_size, *_parallel_ranks()

    def save_checkpoint(self, path: str | Path) -> Path:
        """Shape, weights and version, loadable with ``checkpoint=path`` at the same tp x pp.
        Each rank writes its own shard's file (``path`` itself at tp = pp = 1, else named with
        the rank: ``megatron_checkpoint.shard_file``); returns the file this rank wrote."""
        layout = self._layout()
        file = shard_file(Path(path), *layout)
        arch = (
            {"hf_config": self.shape.config}
            if isinstance(self.shape, HFArch)
            else {"model": self.shape.model_dump()}
        )
        torch.save(
            {
                "format": CHECKPOINT_FORMAT,
                **arch,
                **layout_fields(*layout),
                "version": self.version,
                "state": self._own_state(),
            },
            file,
        )
        return file

    # -- the step -------------------------------------------------------------------------

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        if self.config.pipeline_parallel_size > 1:
            raise TrainerError(
                "a step with pipeline_parallel_size > 1 needs megatron's pipeline schedule, "
                "which this backend does not run yet; use tensor parallelism"
            )
        # the shared sequence (the torch backend's too): the same updates and metrics
        return super()._step(batch, advantages)

    def _check_samples(self, batch: Sequence[TrainSample]) -> None:
        for s in batch:
            _check_sample(s, self.shape)

    def _update(self, samples: list[TrainSample], advantages: list[float]) -> dict[str, float] | None:
        """One optimizer update over ``samples``, in micro-batches whose gradients add up to
        the mini-batch's."""
        cfg = self.config
        for s in samples:  # fail before any backward, not half-way through the accumulation
            _check_sample(s, self.shape)
        token_total = sum(sum(s.token_mask) for s in samples)
        if token_total == 0:
            return None
        seq_total = sum(1 for s in samples if any(s.token_mask))
        micro = cfg.micro_batch_size or len(samples)
        self.optimizer.zero_grad(set_to_none=True)
        out = dict.fromkeys(
            ("loss", "pg_loss", "kl", "entropy", "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl"),
            0.0,
        )
        for start in range(0, len(samples), micro):
            part = samples[start : start + micro]
            packed = self._pack(part)
            n_tok = float(packed.mask.sum())
            if n_tok == 0:
                continue
            # the micro-batch's share of the mini-batch's aggregate: its gradients add up to it
            if cfg.loss_agg == "token_mean":
                weight = n_tok / token_total
            else:
                weight = sum(1 for s in part if any(s.token_mask)) / seq_total
            tok_weight = n_tok / token_total
            adv = torch.tensor(advantages[start : start + micro], dtype=torch.float32, device=self.device)
            logp, ent_tok = self._logprobs_and_entropy(self.model, packed)
            pg, stats = policy_loss(
                logp,
                packed.old,
                adv,
                packed.mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                clip_ratio_c=cfg.clip_ratio_c,
                agg=cfg.loss_agg,
            )
            # entropy at the trained positions; a gradient only when it is rewarded (a detached
            # output adds nothing to the backward pass)
            ent = aggregate(ent_tok if self.entropy_coef > 0 else ent_tok.detach(), packed.mask, cfg.loss_agg)
            loss = pg - self.entropy_coef * ent
            kl = torch.zeros((), device=self.device)
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._logprobs_and_entropy(self.reference, packed)
                kl = aggregate(kl_k3(logp, ref, packed.mask), packed.mask, cfg.loss_agg)
                loss = loss + cfg.kl_coef * kl
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            out["loss"] += weight * loss.item()
            out["pg_loss"] += weight * pg.item()
            out["kl"] += weight * kl.item()
            out["entropy"] += weight * ent.item()
            for k in ("clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl"):
                out[k] += tok_weight * float(stats[k])
        norm = self._clip_gradients(cfg.grad_clip)
        if not math.isfinite(norm):
            # one bad batch must not poison the weights the engines will load
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(f"non-finite gradient norm ({norm}); update skipped")
        self.optimizer.step()
        out["grad_norm"] = norm
        return out

    def _logprobs_and_entropy(self, model: torch.nn.Module, packed: Packed) -> tuple[Tensor, Tensor]:
        """Per completion token, its logprob and the entropy at its position (``[B, C]``
        fp32), under the sampler's restriction and temperature. The policy, the reference
        and ``logprobs()`` all come through here."""
        logits = self._completion_logits(model, packed)
        if self._vocab_range is None:
            return logprobs_and_entropy(logits, packed.targets, self.config.temperature, packed.restrict)
        # tp > 1: ``logits`` are this rank's vocabulary columns. NOT YET RUN on GPUs: the math
        # is tested on CPU processes (tests/core/test_lean_logprobs_tp.py); this wiring was
        # checked once by hand, not in the suite, against megatron-core 0.19.2's GPTModel at
        # tp = 2 on gloo CPU processes (its CUDA-only calls patched out): the same logprobs,
        # entropy and parameter gradients as the gathered tp = 1 path. NCCL, CUDA and bf16
        # autocast at tp > 1 are untried
        first, last = self._vocab_range
        if logits.shape[-1] != last - first:
            raise TrainerError(
                f"the output layer gave {logits.shape[-1]} vocabulary columns on this rank, "
                f"expected [{first}, {last}) of vocab_size={self.shape.vocab_size}"
            )
        restrict = None if packed.restrict is None else packed.restrict[:, first:last]
        return vocab_parallel_logprobs_and_entropy(
            logits,
            packed.targets,
            self.config.temperature,
            restrict,
            vocab_start=first,
            group=self._parallel_state.get_tensor_model_parallel_group(),
        )

    def _completion_logits(self, model: torch.nn.Module, packed: Packed) -> Tensor:
        """The logits at the positions that score completion tokens, ``[B, C, V]`` (``[B, C,
        V / tp]``, this rank's columns, when tp > 1), in the model's dtype (bf16 under
        autocast): ``lean_logprobs`` takes fp32 a chunk at a time and adds the restriction
        after that cast (-1e9 is not exact in bf16)."""
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.config.bf16 else contextlib.nullcontext()
        )
        with autocast:
            # attention_mask=None: the local spec's attention is causal and builds its own mask;
            # sequences are right-padded, so no real position sees a pad
            logits = model(packed.ids, packed.position_ids, None)
        rows = torch.arange(packed.ids.shape[0], device=self.device)[:, None]
        # a copy of the [B, C] rows only: the full [B, T, V] output is freed on return
        out: Tensor = logits[rows, packed.positions]
        return out

    def _clip_gradients(self, max_norm: float | None) -> float:
        """Global L2 norm over every rank's unique shard (duplicated TP parameters count
        once), then scale all gradients down to ``max_norm``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        unique = [p.grad for p in params if self._not_duplicate(p) and p.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in unique:
            sq += g.detach().float().pow(2).sum()
        if self.config.tensor_parallel_size > 1:
            torch.distributed.all_reduce(sq, group=self._parallel_state.get_tensor_model_parallel_group())
        norm = float(sq.sqrt())
        if max_norm is not None and math.isfinite(norm) and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        return norm

    def _pack(self, samples: list[TrainSample]) -> Packed:
        for s in samples:
            _check_sample(s, self.shape)
        return pack_samples(samples, self.shape.vocab_size, self.device)

    def _load(self, state: Mapping[str, Tensor], source: str) -> None:
        result = self.model.load_state_dict(dict(state), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise TrainerError(
                f"checkpoint {source} does not fit the model: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )


def _check_sample(s: TrainSample, shape: GPTShape | HFArch) -> None:
    """An out-of-range id would be a device-side assert on the GPU: say it here instead."""
    n = len(s.prompt_ids) + len(s.completion_ids)
    if n > shape.max_sequence_length:
        raise TrainerError(
            f"a sample of {n} tokens exceeds the model's max_sequence_length={shape.max_sequence_length}"
        )
    ids = s.prompt_ids + s.completion_ids + (s.allowed_token_ids or [])
    bad = [t for t in ids if not 0 <= t < shape.vocab_size]
    if bad:
        raise TrainerError(f"token id {bad[0]} is outside the model's vocab_size={shape.vocab_size}")
