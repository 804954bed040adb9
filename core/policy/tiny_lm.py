"""A small causal transformer LM in plain PyTorch: the embedded default policy.

Pre-LayerNorm blocks, rotary position embeddings (RoPE), tied input/output embeddings, no
dropout (an RL policy's logprobs must be a pure function of the weights: the engine's
sampling logprobs and the trainer's recomputed ones have to agree).

RoPE rather than learned absolute positions because the environments put the same
structure (a map, a position line) at different offsets from turn to turn: attention by
relative offset ("the tile right of ``@``", "the tile one row below") then transfers.

Two ways to run it:

* ``forward(ids, attention_mask)`` -> logits, for training (right- or left-padded batches).
* ``forward_cached(ids, ..., past=...)`` -> ``(logits, new_kv)``, for incremental decoding:
  ``past`` holds each layer's rotated keys and values of the tokens already seen, so a
  decoding step costs one token, not the whole prefix. The engine owns the cache.

Padding is a mask, positions are explicit (``position_ids``), so a left-padded row computes
exactly what the same row computes unpadded. Initialisation draws from its own
``torch.Generator(seed)``: the same config and seed give the same weights, whatever else
the process did with the global RNG.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.config_backends import TinyLMConfig as TinyLMConfig  # the shape: torch-free, for the job config

#: One layer's cache: rotated keys and values, each ``[batch, heads, tokens, head_dim]``.
KV = tuple[Tensor, Tensor]

_CONFIG_FILE = "config.json"
_WEIGHTS_FILE = "model.pt"


class _Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: KV | None
    ) -> tuple[Tensor, KV]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        new = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d)), new


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.down = nn.Linear(cfg.ff, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: KV | None
    ) -> tuple[Tensor, KV]:
        a, kv = self.attn(self.ln1(x), cos, sin, mask, past)
        x = x + a
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return x, kv


class TinyLM(nn.Module):
    _cos: Tensor
    _sin: Tensor

    def __init__(self, config: TinyLMConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        half = config.d_model // config.n_heads // 2
        inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(config.max_len, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        # over the whole head_dim, as ``_rotate`` multiplies: [cos, cos] and [-sin, sin]. Not
        # persistent: derived from the config, so state_dicts hold weights only
        self.register_buffer("_cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("_sin", torch.cat([-sin, sin], dim=-1), persistent=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init: N(0, init_std) for matrices (output projections scaled down by
        ``sqrt(2 * n_layers)`` so the residual stream starts small), identity LayerNorms."""
        g = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.startswith("ln") or ".ln" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith(("attn.out.weight", "down.weight")):
                    p.normal_(0.0, std / math.sqrt(2 * self.config.n_layers), generator=g)
                else:
                    p.normal_(0.0, std, generator=g)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- running
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits ``[batch, tokens, vocab]``. ``attention_mask`` (1 = real token) may pad
        on either side; positions then count real tokens only."""
        logits, _ = self.forward_cached(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return logits

    def forward_cached(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past: list[KV] | None = None,
        past_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[KV]]:
        """Logits of ``input_ids`` after the cached ``past`` tokens, and the new tokens'
        keys/values per layer (the caller appends them to its cache).

        ``past_mask`` marks the real (non-padding) entries of ``past``; ``position_ids`` are
        required with a past (the cache does not know how many real tokens a row holds).
        """
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        attention_mask = attention_mask.bool()
        p = 0 if past is None else past[0][0].shape[2]
        if position_ids is None:
            if past is not None:
                raise ValueError("position_ids are required with a past")
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if past is not None and past_mask is None:
            past_mask = torch.ones(b, p, dtype=torch.bool, device=input_ids.device)
        if int(position_ids.max()) >= self.config.max_len:
            raise ValueError(
                f"sequence position {int(position_ids.max())} is beyond max_len={self.config.max_len}"
            )
        mask = _attention_mask(attention_mask, past_mask)
        cos, sin = self._cos[position_ids][:, None], self._sin[position_ids][:, None]
        x = self.embed(input_ids)
        new_kv: list[KV] = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, cos, sin, mask, None if past is None else past[i])
            new_kv.append(kv)
        logits = F.linear(self.ln_f(x), self.embed.weight)  # tied output embedding
        return logits, new_kv

    # -- persistence
    def save_pretrained(self, directory: str | Path) -> None:
        """``config.json`` + ``model.pt`` (a plain ``state_dict``)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / _CONFIG_FILE).write_text(self.config.model_dump_json(indent=2) + "\n")
        torch.save(self.state_dict(), d / _WEIGHTS_FILE)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> TinyLM:
        d = Path(directory)
        config = TinyLMConfig.model_validate(json.loads((d / _CONFIG_FILE).read_text()))
        model = cls(config)
        model.load_state_dict(torch.load(d / _WEIGHTS_FILE, map_location="cpu", weights_only=True))
        return model


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``[batch, heads, tokens, head_dim]`` with the half-split pairing: ``(x1, x2)``
    becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``, given ``cos`` = [cos, cos] and ``sin`` =
    [-sin, sin] over the head_dim (``TinyLM._cos``, ``_sin``).

    Whole-width products on a contiguous copy: q and k arrive as strided views of the qkv
    projection, and the half-width products over them were 10-15% of a forward pass. The
    same floats as the half-width formula (``a + b * -s`` is ``a - b * s``, and a sum
    commutes), so the engine's and the trainer's logprobs are unchanged bit for bit."""
    x = x.contiguous()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


def _attention_mask(mask: Tensor, past_mask: Tensor | None) -> Tensor:
    """Boolean ``[batch, 1, new, past + new]``: True where a query may attend.

    A query sees the real past tokens and the real new tokens up to itself. A padding query
    also sees itself, so no softmax row is empty (an all-masked row would give NaN, which
    would then leak through the padded positions' gradients).
    """
    b, t = mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    allowed = causal[None] & mask[:, None, :]
    allowed |= torch.eye(t, dtype=torch.bool, device=mask.device)[None]
    if past_mask is not None:
        allowed = torch.cat([past_mask.bool()[:, None, :].expand(b, t, -1), allowed], dim=-1)
    return allowed[:, None]
