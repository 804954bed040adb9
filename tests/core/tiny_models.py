"""Test helpers shared by the engine and proxy tests (importable: pytest puts ``tests/core``
on ``sys.path``)."""

from __future__ import annotations

import torch

from core.policy.tiny_lm import TinyLM
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Completion, GenerateRequest


def stopless(model: TinyLM, tok: WordTokenizer) -> TinyLM:
    """The same model, made never to end a turn: the final norm outputs a constant vector u
    and the stop tokens' (tied) embeddings point away from it, so generation always runs to
    ``max_new_tokens`` while the other tokens stay near-uniform (a long turn is reliably
    still in flight when a test aborts it)."""
    with torch.no_grad():
        u = torch.zeros(model.config.d_model)
        u[0] = 1.0
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(u)
        for i in tok.stop_ids:
            model.embed.weight[i] = -20 * u
    return model


def completion(request: GenerateRequest, n: int, text: str = "") -> Completion:
    """A finished turn of ``n`` tokens answering ``request`` (fake engines and replicas)."""
    return Completion(
        request_id=request.request_id,
        text=text,
        prompt_ids=list(request.prompt_ids or []),
        token_ids=[1] * n,
        logprobs=[0.0] * n,
        policy_version=0,
        finish_reason="length",
    )
