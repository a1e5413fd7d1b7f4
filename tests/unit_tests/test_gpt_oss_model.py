"""gpt-oss's model, in process: the published flavors' parameter counts from meta-device models,
the attention kernel (sinks, bands, documents) against an independent float64 reference and
FlexAttention's path, biased clamped-SwiGLU experts on every expert path, and the FLOP count of
banded blocks."""

import dataclasses

import pytest
import torch

from tests.tolerances import largest_difference
from torchtitan.models.gpt_oss import gpt_oss_configs
from torchtitan.models.gpt_oss.model import GptOss, block_flops, param_counts, sink_attention
from torchtitan.models.moe import MoE


@pytest.mark.parametrize("flavor,total,activated", [("20B", 20.91e9, 3.61e9), ("120B", 116.83e9, 5.13e9)])
def test_published_flavors_have_the_published_parameter_counts(flavor, total, activated):
    """OpenAI's model card: 20.91B total / 3.61B activated, 116.83B / 5.13B (to the hundredth of a
    billion it gives); the meta-device model holds exactly what the shape formula counts."""
    args = dataclasses.replace(gpt_oss_configs[flavor], max_seq_len=16)
    with torch.device("meta"):
        model = GptOss(args)
    held = sum(p.numel() for p in model.parameters())
    counted_total, counted_activated = param_counts(args)
    assert held == counted_total
    assert abs(counted_total - total) < 0.005e9 and abs(counted_activated - activated) < 0.005e9


def _reference(q, k, v, sinks, window, documents):
    """Attention with one extra softmax column per head (the sink's logit, value zero), float64."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seq = q.shape[2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    allowed = (j <= i) & ((j > i - window) if window else True)
    allowed = allowed & (documents.unsqueeze(2) == documents.unsqueeze(1)).unsqueeze(1) if documents is not None \
        else allowed
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return scores.softmax(-1)[..., :seq] @ v


@pytest.mark.parametrize("window,with_documents", [(None, False), (5, False), (4, True)])
def test_sink_attention_matches_a_reference_and_flex_attention(window, with_documents):
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 16, 8
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, dim, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, requires_grad=True)
    documents = torch.tensor([[0] * 6 + [1] * 10, [0] * 16]) if with_documents else None
    dout = torch.randn(batch, heads, seq, dim)
    expected = _reference(q, k, v, sinks, window, documents)
    expected_grads = torch.autograd.grad(expected, (q, k, v, sinks), dout.double())
    # Sums over the head dim, the keys (scores and weighted values), and in backward the rows too.
    bound = largest_difference(torch.float32, 2 * dim + 3 * seq + batch * seq, 4.0)
    out = sink_attention(q, k, v, documents, sinks=sinks, window=window)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    assert (out.double() - expected).abs().max() < bound
    for got, want in zip(grads, expected_grads):
        assert (got.double() - want).abs().max() < bound
    # FlexAttention's path (CUDA's), forward only: PyTorch runs its backward on GPUs alone.
    flex = sink_attention(q.detach(), k.detach(), v.detach(), documents, sinks=sinks.detach(), window=window,
                          flex=True)
    assert (flex.double() - expected).abs().max() < bound
    # A query's weights sum to less than one: the sink takes its share (zero values in, zero out).
    ones = sink_attention(q, k, torch.ones_like(v), documents, sinks=sinks, window=window)
    assert bool((ones < 1).all()) and bool((ones > 0).all())


def test_biased_clamped_experts_agree_on_every_path():
    """Biases and the clamped SwiGLU through the grouped kernel, the per-expert loop and the
    dropping mode's padded layout (a capacity every choice fits: nothing dropped)."""
    torch.manual_seed(0)
    moe = MoE(16, 24, 4, 2, linear_biases=True, swiglu_limit=1.5, swiglu_alpha=1.702)
    moe.init_weights(0.02)
    with torch.no_grad():
        for bias in (moe.experts.b1, moe.experts.b2, moe.experts.b3, moe.router.gate.bias):
            bias.normal_()
        moe.experts.w1.mul_(50)  # gates beyond the limit, so that the clamp acts
    x = torch.randn(2, 6, 16)
    grouped = moe(x)
    moe.experts.use_grouped_mm = False
    loop = moe(x)
    moe.capacity_factor = float(moe.num_experts)
    padded = moe(x)
    bound = largest_difference(torch.float32, 16 + 24 + 2, grouped.abs().max().item())
    assert (grouped - loop).abs().max() < bound and (grouped - padded).abs().max() < bound
    gate = torch.einsum("td,ehd->teh", x.view(-1, 16), moe.experts.w1) + moe.experts.b1
    assert bool((gate > 1.5).any()), "the test should reach the clamp"


def test_banded_blocks_cost_less_attention_than_full_ones():
    args = gpt_oss_configs["20B"]
    banded, full = block_flops(args, 0, 8192), block_flops(args, 1, 8192)
    assert args.layer_window(0) == 128 and args.layer_window(1) is None
    assert full - banded == 12 * args.n_heads * args.head_dim * (8192 - 256)
    # At a sequence shorter than twice the window both see (on average) the same keys.
    assert block_flops(args, 0, 128) == block_flops(args, 1, 128)


def test_shapes_the_model_cannot_take_are_refused():
    args = gpt_oss_configs["tiny"]
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        GptOss(dataclasses.replace(args, n_kv_heads=3))
    with pytest.raises(ValueError, match="layer_types names 1 blocks"):
        GptOss(dataclasses.replace(args, layer_types=("full_attention",)))


def test_a_window_below_one_is_refused_by_context_parallel_attention():
    from torchtitan.parallelisms.cp_attention import cp_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention window 0 must be at least 1"):
        cp_attention(q, q, q, group_name="unused", window=0)
