"""Tests for the Llama Transformer: published sizes, meta-device init, forward, GQA, RoPE, FLOPs."""

import math

import pytest
import torch
from torch import nn

from tests.tolerances import reordered_sums, rounded_ops
from torchtitan.models.llama import llama2_configs, llama3_configs
from torchtitan.models.llama.model import (
    ModelArgs,
    RopeScaling,
    Transformer,
    apply_rope,
    ffn_hidden_dim,
    precompute_rope,
)
from torchtitan.models.loss import cross_entropy_loss

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32, multiple_of=16)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def build_on_meta(args):
    with torch.device("meta"):
        return Transformer(args)


def build_tiny(seed=0, **overrides):
    args = ModelArgs(**{**TINY, **overrides})
    model = build_on_meta(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize(
    "configs,flavor,billions",
    [(llama3_configs, "8B", 8.03), (llama2_configs, "7B", 6.74), (llama3_configs, "70B", 70.55),
     (llama3_configs, "405B", 405.85), (llama3_configs, "1B", 1.24), (llama3_configs, "3B", 3.21)],
)
def test_published_parameter_counts(configs, flavor, billions):
    assert round(n_params(build_on_meta(configs[flavor])) / 1e9, 2) == billions


def test_llama32_small_models_match_their_published_shapes():
    """Llama 3.2 1B and 3B (tied embeddings): exact parameter counts and feed-forward sizes."""
    for flavor, total, hidden in (("1B", 1_235_814_400, 8192), ("3B", 3_212_749_824, 8192)):
        model = build_on_meta(llama3_configs[flavor])
        assert model.output.weight is model.tok_embeddings.weight
        assert n_params(model) == total
        assert model.layers["0"].feed_forward.w1.out_features == hidden


@pytest.mark.parametrize(
    "args,hidden",
    [(llama3_configs["8B"], 14336), (ModelArgs(dim=256, multiple_of=256), 768), (llama2_configs["7B"], 11008),
     (llama3_configs["70B"], 28672), (llama3_configs["405B"], 53248)],
)
def test_ffn_hidden_dim(args, hidden):
    assert ffn_hidden_dim(args) == hidden


def test_meta_init_and_forward():
    model = build_tiny()
    assert all(p.device.type == "cpu" for p in model.parameters())
    torch.testing.assert_close(model.rope_cache, precompute_rope(model.args), rtol=0, atol=0)
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 100)
    assert torch.isfinite(logits).all()


def test_init_is_seeded():
    a, b, c = build_tiny(seed=1).state_dict(), build_tiny(seed=1).state_dict(), build_tiny(seed=2).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_layer_names():
    model = build_on_meta(ModelArgs(**TINY))
    assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers.keys()) == ["0", "1"]
    names = {name for name, _ in model.named_parameters()}
    assert "layers.0.attention.wq.weight" in names
    assert "layers.1.feed_forward.w3.weight" in names
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= names


def test_parameter_count_formula():
    model = build_on_meta(ModelArgs(**TINY))
    dim, vocab, head_dim, kv = 64, 100, 16, 2
    hidden = 176  # int(8 * 64 / 3) = 170, rounded up to a multiple of 16
    per_layer = 2 * dim * dim + 2 * dim * kv * head_dim + 3 * dim * hidden + 2 * dim
    assert n_params(model) == 2 * per_layer + dim + 2 * vocab * dim


def test_tied_embeddings_share_one_parameter():
    untied = build_on_meta(ModelArgs(**TINY))
    tied = build_on_meta(ModelArgs(**TINY, tie_word_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert n_params(tied) == n_params(untied) - 100 * 64


def test_tied_embeddings_survive_meta_to_empty_init():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ModelArgs(**TINY, tie_word_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert n_params(model) == n_params(build_on_meta(ModelArgs(**TINY))) - 100 * 64
    assert torch.isfinite(model(torch.randint(0, 100, (1, 8)))).all()


def test_tied_model_starts_near_the_uniform_loss():
    """The shared matrix is initialised at the output projection's scale, so the first loss is
    about ln(vocab), as for an untied model, and not in the hundreds."""
    tokens = torch.randint(0, 100, (2, 16))
    for tie in (False, True):
        model = build_tiny(tie_word_embeddings=tie)
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        assert abs(loss.item() - math.log(100)) < 1.0, (tie, loss.item())


def test_causality():
    model = build_tiny()
    tokens = torch.randint(0, 100, (1, 16))
    changed = tokens.clone()
    t = 9
    changed[0, t] = (tokens[0, t] + 1) % 100
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


def reference_attention(attn, x, rope, n_heads, n_kv_heads):
    bsz, seq, _ = x.shape
    head_dim = attn.wq.weight.shape[0] // n_heads
    q = (x @ attn.wq.weight.T).view(bsz, seq, n_heads, head_dim)
    k = (x @ attn.wk.weight.T).view(bsz, seq, n_kv_heads, head_dim)
    v = (x @ attn.wv.weight.T).view(bsz, seq, n_kv_heads, head_dim)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
    v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(bsz, seq, n_heads * head_dim)
    return out @ attn.wo.weight.T


def test_grouped_query_attention_matches_repeated_kv_heads():
    model = build_tiny()
    attn = model.layers["1"].attention
    x = torch.randn(2, 16, 64)
    rope = model.rope_cache[:16]
    with torch.no_grad():
        expected = reference_attention(attn, x, rope, n_heads=4, n_kv_heads=2)
        got = attn(x, rope)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_apply_rope_rotates_adjacent_pairs():
    args = ModelArgs(dim=64, n_heads=4, max_seq_len=8)
    rope = precompute_rope(args)
    assert rope.shape == (8, 8, 2)
    x = torch.randn(2, 8, 3, 16)
    y = apply_rope(x, rope)
    pair_norm = lambda t: t.unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: identity
    assert not torch.allclose(y[:, 1], x[:, 1])
    # Independent reference: pair (a, b) at position p turns by p * theta^(-2i/d).
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = torch.arange(8, dtype=torch.float64)[:, None] * freqs  # (seq, pairs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    expected = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_rope_depends_on_relative_position_only():
    rope = precompute_rope(ModelArgs(dim=64, n_heads=4, max_seq_len=16))
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    at = lambda t, p: apply_rope(t, rope[p : p + 1])  # noqa: E731
    dot = lambda m, n: (at(q, m) * at(k, n)).sum()  # noqa: E731
    # Equal in exact arithmetic; in fp32, sums of 16 products of values each rotated by a few rounded
    # operations (4 per factor, the fp32 table's cos and sin included) at other angles.
    tolerance = reordered_sums(torch.float32, 16 + 2 * 4, float((q.abs() * k.abs()).sum()))
    torch.testing.assert_close(dot(5, 2), dot(12, 9), **tolerance)
    torch.testing.assert_close(dot(3, 3), dot(0, 0), **tolerance)


def rope_freqs(args):
    rope = precompute_rope(args)  # position 1's angles are the frequencies themselves
    return torch.atan2(rope[1, :, 1].double(), rope[1, :, 0].double())


def test_rope_scaling():
    base = dict(dim=128, n_heads=1, rope_theta=500000.0, max_seq_len=2)
    s = RopeScaling()
    plain = rope_freqs(ModelArgs(**base))
    scaled = rope_freqs(ModelArgs(**base, rope_scaling=s))
    expected_plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    torch.testing.assert_close(plain, expected_plain, rtol=1e-5, atol=0)

    wavelen = 2 * math.pi / plain
    high = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    low = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert high[0] and low[-1]
    torch.testing.assert_close(scaled[high], plain[high], rtol=1e-5, atol=0)
    torch.testing.assert_close(scaled[low], plain[low] / s.factor, rtol=1e-5, atol=0)
    assert (scaled[mid] < plain[mid]).all() and (scaled[mid] > plain[mid] / s.factor).all()
    smooth = (s.original_max_position_embeddings / wavelen[mid] - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * plain[mid] / s.factor + smooth * plain[mid]
    torch.testing.assert_close(scaled[mid], blended, rtol=1e-5, atol=0)


def test_flops_per_token_untied():
    model = build_on_meta(ModelArgs(**TINY))
    non_embedding = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings"))
    assert non_embedding == n_params(model) - 100 * 64
    seq_len = 32
    expected = 6 * non_embedding + 12 * 2 * 4 * 16 * seq_len
    assert model.flops_per_token(seq_len) == expected


def test_apply_rope_compiled_form_matches_eager():
    """The real-valued form used under torch.compile equals the eager complex multiply."""
    rope = precompute_rope(ModelArgs(dim=64, n_heads=4, max_seq_len=8))
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 16)
    compiled = torch.compile(apply_rope, backend="eager", fullgraph=True)
    # a cos - b sin (or a sin + b cos) in two orders of rounding: up to 3 rounded operations each.
    torch.testing.assert_close(compiled(x, rope), apply_rope(x, rope), **rounded_ops(torch.float32, 3, float(x.abs().max())))
