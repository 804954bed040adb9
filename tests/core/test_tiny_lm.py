import pytest
import torch
from pydantic import ValidationError

from core.policy.tiny_lm import TinyLM, TinyLMConfig

CFG = TinyLMConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_len=48)


def ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def test_init_is_deterministic_per_seed_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = TinyLM(CFG, seed=1).state_dict()
    torch.manual_seed(456)
    torch.rand(1000)
    b = TinyLM(CFG, seed=1).state_dict()
    c = TinyLM(CFG, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert torch.equal(a["ln_f.weight"], torch.ones(CFG.d_model))


def test_forward_shapes_and_causality():
    m = TinyLM(CFG).eval()
    x = ids(2, 10)
    logits = m(x)
    assert logits.shape == (2, 10, CFG.vocab_size)
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % CFG.vocab_size  # changing the future leaves the past alone
    assert torch.allclose(m(y)[:, :7], logits[:, :7], atol=1e-6)
    assert not torch.allclose(m(y)[:, 7:], logits[:, 7:])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_invisible(side):
    m = TinyLM(CFG).eval()
    x = ids(1, 9)
    ref = m(x)
    pad = torch.zeros(1, 4, dtype=torch.long)
    ones, zeros = torch.ones(1, 9, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool)
    if side == "left":
        out = m(torch.cat([pad, x], 1), torch.cat([zeros, ones], 1))[:, 4:]
    else:
        out = m(torch.cat([x, pad], 1), torch.cat([ones, zeros], 1))[:, :9]
    assert torch.allclose(out, ref, atol=1e-5)


def test_kv_cache_decoding_matches_full_forward():
    m = TinyLM(CFG).eval()
    x = ids(3, 12)
    full = m(x)
    logits, kv = m.forward_cached(x[:, :8], position_ids=torch.arange(8).expand(3, 8))
    steps = [logits[:, -1]]
    for t in range(8, 12):
        out, new = m.forward_cached(x[:, t : t + 1], position_ids=torch.full((3, 1), t), past=kv)
        kv = [
            (torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(kv, new, strict=True)
        ]
        steps.append(out[:, -1])
    assert torch.allclose(torch.stack(steps[:-1], 1), full[:, 7:11], atol=1e-5)


def test_positions_beyond_max_len_are_refused():
    m = TinyLM(CFG)
    with pytest.raises(ValueError, match="beyond max_len=48"):
        m(ids(1, 49))
    with pytest.raises(ValueError, match="position_ids are required"):
        m.forward_cached(ids(1, 1), past=[(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))] * 2)


def test_config_is_validated():
    with pytest.raises(ValidationError, match="multiple of n_heads"):
        TinyLMConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ValidationError, match="even"):
        TinyLMConfig(vocab_size=10, d_model=12, n_heads=4)
    with pytest.raises(ValidationError, match="extra"):
        TinyLMConfig(vocab_size=10, dropout=0.1)  # type: ignore[call-arg]
    assert TinyLMConfig(vocab_size=10).ff == 256


def test_save_and_load(tmp_path):
    m = TinyLM(CFG, seed=3)
    m.save_pretrained(tmp_path / "m")
    again = TinyLM.from_pretrained(tmp_path / "m")
    assert again.config == CFG
    x = ids(2, 6)
    assert torch.equal(again(x), m(x))
    assert set(m.state_dict()) == set(again.state_dict())
    assert not any("_cos" in k or "_sin" in k for k in m.state_dict())  # derived, not saved


def test_gradients_reach_every_parameter():
    m = TinyLM(CFG)
    m(ids(2, 6)).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_rope_rotates_each_half_split_pair_by_its_angle():
    # q and k reach _rotate as strided views of the qkv projection; the result must be the
    # same floats as the half-width formula (engine and trainer logprobs depend on them)
    from core.policy.tiny_lm import _rotate

    m = TinyLM(CFG)
    b, h, t, hd = 2, CFG.n_heads, 11, CFG.d_model // CFG.n_heads
    qkv = torch.randn(b, t, 3, h, hd, generator=torch.Generator().manual_seed(3))
    x = qkv.permute(2, 0, 3, 1, 4)[1]  # k's view: [batch, heads, tokens, head_dim], strided
    pos = torch.tensor([[0, 0, 0, *range(8)], list(range(11))])  # a left-padded row, a full one
    half = hd // 2
    inv_freq = CFG.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = (pos[..., None].float() * inv_freq)[:, None]  # [batch, 1, tokens, half]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    got = _rotate(x, m._cos[pos][:, None], m._sin[pos][:, None])
    assert torch.equal(got, want)
    # and it is the rotation: pair (i, i + half) as a complex number times e^(i angle)
    z = torch.complex(x1, x2) * torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(got, torch.cat([z.real, z.imag], dim=-1), atol=1e-5)
