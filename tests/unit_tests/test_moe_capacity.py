"""The MoE dropping mode (`MoE.capacity_factor`, torchtitan/models/moe.py): equal to dropless when
nothing overflows; the dropped (token, choice) pairs exactly the later ones beyond each sequence's
capacity, with gradients as a reference that zeroes them; no host read and no data-dependent shape in
forward and backward; counted once under activation checkpointing; logged by `moe_after_step`; and
expert parallelism's static dispatch under the dry run, which never exchanges counts."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from tests.tolerances import assert_reordered, reordered_sums
from torchtitan.models.moe import MoE
from torchtitan.parallelisms.expert_parallel import moe_after_step
from torchtitan.runtime.torch_compat.fake import FakeTensorMode

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2  # multiples of 8: torch._grouped_mm runs them on CPU in fp32
# The layer's sums: the router's logits (over DIM) and softmax (over EXPERTS), the experts' w1 and w3
# (over DIM) and w2 (over HIDDEN), the top-k combine; a gradient adds the tokens it sums over.
LAYER_SUMS = DIM + EXPERTS + DIM + HIDDEN + TOP_K


def make_moe(seed=0, **kwargs):
    """Weights at a scale where routing is far from uniform (so some experts overflow)."""
    torch.manual_seed(seed)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.normal_(0, w.shape[-1] ** -0.5)
    return moe


def forward_backward(moe, x, g):
    """Output and the gradients of every parameter and of x."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    return [out.detach()] + [p.grad.clone() for p in moe.parameters()] + [x.grad.clone()]


def routing_of(moe, x):
    """The layer's own routing of x (what the router chose; the router is not under test here)."""
    seen = []
    handle = moe.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    with torch.no_grad():
        moe(x)
    handle.remove()
    _, experts, weights = seen[0]
    return experts.view(*x.shape[:2], -1), weights.view(*x.shape[:2], -1)


def kept_reference(experts, cap):
    """Pure-Python expectation: in each sequence, walking positions in order and each token's
    choices in order, an expert keeps a pair while it holds fewer than `cap` of that sequence's."""
    bsz, seqlen, k = experts.shape
    kept = torch.zeros(bsz, seqlen, k, dtype=torch.bool)
    for b in range(bsz):
        taken = [0] * EXPERTS
        for s in range(seqlen):
            for j in range(k):
                e = int(experts[b, s, j])
                if taken[e] < cap:
                    kept[b, s, j] = True
                    taken[e] += 1
    return kept


def reference_output(moe, x, experts, kept):
    """Each token's kept choices' expert outputs, weighted by their renormalised router
    probabilities (differentiable in x and the gate); dropped choices add nothing."""
    probs = torch.softmax((x @ moe.router.gate.weight.T).float(), dim=-1)
    weights = probs.gather(-1, experts)
    weights = weights / weights.sum(-1, keepdim=True)
    e = moe.experts
    out = torch.zeros_like(x)
    for i in range(EXPERTS):
        expert = (F.silu(x @ e.w1[i].T) * (x @ e.w3[i].T)) @ e.w2[i].T  # every token through expert i
        w = (weights * ((experts == i) & kept)).sum(-1, keepdim=True)
        out = out + w * expert
    return out


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_a_capacity_nothing_exceeds_equals_dropless(use_grouped_mm):
    """Factor E / k: each expert may take every token of a sequence, so nothing is dropped, and the
    padded layout gives the dropless outputs and gradients (grouped kernel and its fallback): the
    same routing, counts and aux loss bitwise; the values up to the rounding of the experts' matmuls,
    which run on other row counts (B x cap padded rows against each expert's tokens)."""
    torch.manual_seed(1)  # inputs drawn before make_moe seeds: the same ones on every run
    x, g = torch.randn(3, 10, DIM), torch.randn(3, 10, DIM)
    dropless = make_moe(aux_loss_coef=0.1)
    capacity = make_moe(aux_loss_coef=0.1, capacity_factor=EXPERTS / TOP_K)
    assert capacity.capacity(10) == 10
    for moe in (dropless, capacity):
        moe.experts.use_grouped_mm = use_grouped_mm
    expected, got = forward_backward(dropless, x, g), forward_backward(capacity, x, g)
    for a, b in zip(expected, got):  # out, the parameters' gradients (over the 30 tokens), x's
        assert_reordered(b, a, 30 + LAYER_SUMS)
    counts_dropless, aux_dropless, _ = dropless.take_step_stats()
    counts, aux, dropped = capacity.take_step_stats()
    assert torch.equal(counts, counts_dropless) and torch.equal(aux, aux_dropless) and dropped == 0


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_the_later_pairs_beyond_each_sequences_capacity_are_dropped(use_grouped_mm):
    factor = 0.6
    bsz, seqlen = 3, 12
    torch.manual_seed(1)
    x, g = torch.randn(bsz, seqlen, DIM), torch.randn(bsz, seqlen, DIM)
    moe = make_moe(capacity_factor=factor)
    moe.experts.use_grouped_mm = use_grouped_mm
    cap = math.ceil(factor * seqlen * TOP_K / EXPERTS)
    assert moe.capacity(seqlen) == cap == 4
    experts, _ = routing_of(moe, x)
    kept = kept_reference(experts, cap)
    assert 0 < (~kept).sum() < kept.numel() // 2, "the case should drop some pairs, not most"
    moe.take_step_stats()

    xr = x.clone().requires_grad_()
    out = moe(xr)
    (out * g).sum().backward()
    counts, _, dropped = moe.take_step_stats()
    assert dropped == (~kept).sum()
    assert torch.equal(counts, torch.bincount(experts.flatten(), minlength=EXPERTS).float())  # routed, before drops

    # The same from an independent reference, values and gradients.
    ref = make_moe(capacity_factor=factor)
    xs = x.clone().requires_grad_()
    expected = reference_output(ref, xs, experts, kept)
    (expected * g).sum().backward()
    # Another evaluation of the same sums (every token through every expert, then masked).
    for mine, theirs in [(out, expected), (xr.grad, xs.grad),
                         *((p.grad, q.grad) for p, q in zip(moe.parameters(), ref.parameters()))]:
        assert_reordered(mine, theirs, LAYER_SUMS + bsz * seqlen)  # a parameter's gradient sums over the tokens


def test_capacity_is_per_sequence_whatever_the_batch():
    """A sequence gives the same output alone as beside others (other ranks, microbatches)."""
    moe = make_moe(capacity_factor=0.5)
    x = torch.randn(4, 12, DIM)  # after make_moe's seed: the same input on every run
    with torch.no_grad():
        whole = moe(x)
        parts = torch.cat([moe(x[:1]), moe(x[1:3]), moe(x[3:])])
    assert moe.take_step_stats().dropped_tokens > 0
    # The routing must be the same (a dropped pair would differ by a whole expert's output); the
    # values only by rounding: the batch size changes how the CPU's matmul kernels order their sums
    # (AVX2 and AMX differently), over the router's and the experts' dims.
    torch.testing.assert_close(parts, whole, **reordered_sums(torch.float32, LAYER_SUMS))


def test_the_router_gradient_of_a_dropped_choice_is_zero():
    """A dropped pair's weight is zero: perturbing the output gradient only on tokens whose choices
    are all dropped leaves the router's gradient unchanged... and changes it for a kept token."""
    bsz, seqlen = 2, 12
    torch.manual_seed(1)
    x = torch.randn(bsz, seqlen, DIM)
    moe = make_moe(capacity_factor=0.3)  # cap 2 per expert and sequence: most pairs dropped
    experts, _ = routing_of(moe, x)
    kept = kept_reference(experts, moe.capacity(seqlen))
    all_dropped = ~kept.any(-1)
    some_kept = kept.any(-1)
    assert all_dropped.any() and some_kept.any()

    def gate_grad(g):
        moe.zero_grad(set_to_none=True)
        (moe(x) * g).sum().backward()
        return moe.router.gate.weight.grad.clone()

    g = torch.randn(bsz, seqlen, DIM)
    base = gate_grad(g)
    assert torch.equal(gate_grad(g + all_dropped.unsqueeze(-1) * torch.randn_like(g)), base)
    assert not torch.equal(gate_grad(g + some_kept.unsqueeze(-1) * torch.randn_like(g)), base)


class _DataDependentOps(TorchDispatchMode):
    """Records the ops whose result needs a tensor's values on the host, or whose shape depends on them."""

    WATCHED = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.WATCHED):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_capacity_mode_reads_nothing_to_the_host(monkeypatch, use_grouped_mm):
    x, g = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    moe = make_moe(capacity_factor=1.0, aux_loss_coef=0.1)
    moe.experts.use_grouped_mm = use_grouped_mm

    def refuse(*args, **kwargs):
        raise AssertionError("a host read in capacity mode")

    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "tolist", refuse)
        patched.setattr(torch.Tensor, "item", refuse)
        with _DataDependentOps() as ops:
            forward_backward(moe, x, g)
    assert ops.seen == []
    # Dropless routing's counts are data: the loop's split sizes are read to the host
    # (the documented counts per layout: test_moe_host_reads.py).
    moe.capacity_factor = 0.0
    if use_grouped_mm is False:
        with monkeypatch.context() as patched, pytest.raises(AssertionError, match="a host read"):
            patched.setattr(torch.Tensor, "tolist", refuse)
            forward_backward(moe, x, g)


def test_capacity_mode_runs_on_fake_tensors_with_no_seam_replaced():
    """Every shape follows from B, S, k, E and the factor: the layer runs forward and backward on
    tensors with no values, where dropless routing (its counts are data) cannot."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = MoE(DIM, HIDDEN, EXPERTS, TOP_K, capacity_factor=1.25)
        fake.experts.use_grouped_mm = False  # the grouped kernel's shape function takes bf16 only (PyTorch 2.13)
        x = mode.from_tensor(torch.randn(2, 12, DIM)).requires_grad_()
        out = fake(x)
        out.sum().backward()
        assert out.shape == (2, 12, DIM) and fake.experts.w1.grad.shape == fake.experts.w1.shape
        fake.capacity_factor = 0.0
        with pytest.raises(Exception, match="_local_scalar_dense"):  # dropless: the loop reads its counts
            fake(x)


def test_activation_checkpointing_counts_dropped_pairs_once():
    torch.manual_seed(1)
    x, g = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    plain = make_moe(capacity_factor=0.5)
    expected = forward_backward(plain, x, g)
    stats = plain.take_step_stats()
    assert stats.dropped_tokens > 0
    checkpointed = make_moe(capacity_factor=0.5)
    xc = x.clone().requires_grad_()
    out = checkpoint(checkpointed, xc, use_reentrant=False)
    (out * g).sum().backward()
    assert torch.equal(out.detach(), expected[0])
    again = checkpointed.take_step_stats()
    assert torch.equal(again.dropped_tokens, stats.dropped_tokens)
    assert torch.equal(again.tokens_per_expert, stats.tokens_per_expert)


def _one_process():
    return types.SimpleNamespace(stage_mesh=None, pp_enabled=False, moe_gradient_divide_factor=1)


def _model_with(*moes):
    part = nn.Module()
    part.layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": moe}) for i, moe in enumerate(moes)})
    return part


def test_logging_steps_report_dropped_pairs_per_layer_and_the_share():
    x = torch.randn(2, 12, DIM)
    capacity, dropless = make_moe(capacity_factor=0.5), make_moe(seed=1)
    capacity(x)
    dropless(x)
    dropped = capacity.dropped_tokens.item()
    assert dropped > 0
    values, summary = moe_after_step([_model_with(capacity)], _one_process(), log=True)
    assert values["moe_dropped_tokens/layer0"] == dropped
    assert f"dropped: {100 * dropped / (2 * 12 * TOP_K):.2f}%" in summary
    # Dropless layers log as before: no dropped count, no share.
    dropless(x)
    values, summary = moe_after_step([_model_with(dropless)], _one_process(), log=True)
    assert not any(k.startswith("moe_dropped_tokens") for k in values) and "dropped" not in summary


def test_the_dry_run_simulates_capacity_mode_under_expert_parallelism_without_exchanging_counts(monkeypatch):
    """Qwen3 tiny_moe, EP 2, on fake tensors: the static dispatch sends equal splits, so the
    dry run's stand-in for the exchange of counts is never called."""
    from torchtitan.config.manager import parse_args
    from torchtitan.estimation import shapes_only
    from torchtitan.estimation.dry_run import dry_run

    def no_exchange(*args):
        raise AssertionError("capacity mode exchanged counts")

    monkeypatch.setattr(shapes_only, "balanced_exchange", no_exchange)
    args = ["--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml", "--model.flavor", "tiny_moe",
            "--training.seq_len", "128", "--job.dry_run", "--job.dry_run_device", "cpu", "--job.dry_run_world_size", "2",
            "--training.expert_parallel_degree", "2"]
    result = dry_run(parse_args([*args, "--moe.capacity_factor", "1.25"]))
    moe = result.ranks[0].parallelisms["moe"]
    assert moe["capacity_factor"] == 1.25 and moe["ep_mesh"] == {"ep": 2}
    assert result.ranks[0].memory.peak > 0
    with pytest.raises(AssertionError, match="exchanged counts"):  # dropless does exchange them
        dry_run(parse_args(args))


def test_moe_bench_capacity_layer_smoke():
    from scripts import moe_bench

    dropless, capacity = moe_bench.bench_capacity_layer(0.5, sequences=2, seq_len=32, reps=1)
    assert dropless["mode"] == "dropless" and dropless["dropped"] == 0
    assert capacity["mode"] == "capacity 0.5" and 0 < capacity["dropped"] < 1
    assert all(r["layer_ms"] > 0 and r["dispatch_ms"] > 0 for r in (dropless, capacity))
    assert "capacity" in moe_bench.SECTIONS
