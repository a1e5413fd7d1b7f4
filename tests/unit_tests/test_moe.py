"""Tests for the MoE layer (torchtitan/models/moe.py): grouped matmul against the per-expert loop,
the router, dropless routing against a dense reference, the sequence-wise auxiliary loss and its
parallelism seams, step statistics under activation checkpointing, the expert-bias update,
determinism; and a smoke run of scripts/moe_bench.py's grouped-matmul benchmark."""


import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from scripts import moe_bench
from tests.tolerances import assert_reordered, reordered_sums
from torchtitan.models.moe import AuxLossGrad, GroupedExperts, MoE, TokenChoiceRouter, grouped_mm, grouped_mm_supported

DIM, HIDDEN, EXPERTS = 16, 24, 4  # multiples of 8: torch._grouped_mm runs them on CPU in fp32


def make_moe(top_k=2, seed=0, **kwargs):
    """A MoE with weights at a scale where outputs, router probabilities and the aux loss are all
    far from zero (init_weights' 0.02 would make them tiny)."""
    torch.manual_seed(seed)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, **kwargs)
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.normal_(0, w.shape[-1] ** -0.5)
    return moe


def grads(module, *tensors):
    return [p.grad.clone() for p in module.parameters()] + [t.grad.clone() for t in tensors]


def assert_all_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


def assert_all_close(a, b, terms):
    """Gradients whose sums (`terms` terms in all: over the tokens, then the layer's dims) ran in
    another order or split: equal up to fp32 rounding of those sums, at each tensor's scale."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_reordered(x, y, terms)


# A router's sums: each logit a dot product over DIM, each probability a softmax over (at most 8) experts.
ROUTER_SUMS = DIM + 8
# The layer's: the router's, the experts' w1 and w3 (over DIM) and w2 (over HIDDEN), the top-k combine.
LAYER_SUMS = ROUTER_SUMS + DIM + HIDDEN + 2
# The sequence-wise aux loss's (aux_reference): over a sequence's (at most 12) positions, the
# experts, the batch's (at most 4) sequences.
AUX_SUMS = 12 + EXPERTS + 4


# ---------------------------------------------------------------------------------------------
# Independent references


def route_reference(x, gate_weight, top_k, bias=None, norm=True):
    """tokens (T, dim) -> fp32 probabilities (T, E), chosen experts (T, k) sorted by index, weights."""
    probs = torch.softmax((x @ gate_weight.T).double(), dim=-1).float()
    order = torch.argsort(probs if bias is None else probs + bias, dim=-1, descending=True)
    experts = order[:, :top_k].sort(dim=-1).values
    weights = probs.gather(-1, experts)
    return probs, experts, weights / weights.sum(-1, keepdim=True) if norm else weights


def dense_reference(moe, x):
    """Every expert on every token, then each token's top-k outputs combined with their weights."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax((tokens @ moe.router.gate.weight.T).float(), dim=-1)
    chosen = torch.topk(probs, moe.top_k, dim=-1)
    weights = chosen.values / chosen.values.sum(-1, keepdim=True)
    e = moe.experts
    all_out = torch.stack([(F.silu(tokens @ e.w1[i].T) * (tokens @ e.w3[i].T)) @ e.w2[i].T
                           for i in range(moe.num_experts)])  # (E, T, dim)
    picked = all_out[chosen.indices, torch.arange(tokens.shape[0])[:, None]]  # (T, k, dim)
    return (picked * weights.unsqueeze(-1)).sum(1).view_as(x)


def aux_reference(gate_weight, x, top_k, coef, sequences=None):
    """DeepSeek-V3's sequence-wise balance loss: coef x mean over sequences of sum_e f_e P_e, with
    f_e = E / (k S) x (choices of expert e in the sequence) and P_e the sequence's mean probability."""
    bsz, seqlen, _ = x.shape
    probs = torch.softmax((x @ gate_weight.T).float(), dim=-1)  # (B, S, E)
    n_experts = probs.shape[-1]
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, n_experts).sum(2).float()  # (B, S, E)
    f = chosen.sum(1) * n_experts / (top_k * seqlen)
    p = probs.mean(1)
    return coef * (f * p).sum() / (sequences or bsz)


# ---------------------------------------------------------------------------------------------
# Grouped matmul


@pytest.mark.parametrize("counts", [[3, 1, 5, 2], [3, 0, 5, 0], [0, 0, 11, 0], [0, 4, 0, 7]])
def test_grouped_mm_equals_the_loop_exactly(counts):
    counts = torch.tensor(counts)
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    assert grouped_mm_supported(x, w)
    g = torch.randn(x.shape[0], 24)
    outs, all_grads = [], []
    for use_grouped in (True, False):
        out = grouped_mm(x, w, counts, use_grouped)
        outs.append(out)
        all_grads.append(torch.autograd.grad(out, (x, w), g))
    assert torch.equal(outs[0], outs[1])
    assert_all_equal(all_grads[0], all_grads[1])
    # And both are the products they should be (einsum's kernel sums each dot product otherwise).
    rows = torch.repeat_interleave(torch.arange(4), counts)
    expected = torch.einsum("ni,noi->no", x, w[rows])
    assert_reordered(outs[0], expected, 16)
    assert not all_grads[0][1][counts == 0].any()  # an expert without tokens gets no gradient


def test_grouped_experts_equal_the_loop_exactly_in_forward_and_backward():
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, 6)
    experts.init_weights(0.1)
    counts = torch.tensor([5, 0, 9, 1, 0, 3])
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    g = torch.randn(x.shape[0], DIM)
    assert grouped_mm_supported(x, experts.w1, experts.w2, experts.w3)
    results = []
    for mode in (None, False):  # None: torch._grouped_mm here; False: the loop
        experts.use_grouped_mm = mode
        experts.zero_grad()
        x.grad = None
        out = experts(x, counts)
        out.backward(g)
        results.append([out.detach()] + grads(experts, x))
    assert_all_equal(results[0], results[1])
    assert not results[0][1][[1, 4]].any()  # w1 rows of the experts without tokens


class WeightSizedTensors(TorchDispatchMode):
    """Counts the tensors of one shape that the ops run under it produce."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += sum(isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape for t in tree_flatten(out)[0])
        return out


def test_loop_backward_builds_the_weight_gradient_once():
    """The fallback's backward gathers the experts' weight gradients into one stacked tensor, not
    one zero-padded full-size gradient per expert (E x the weight's size in time and memory: a
    30B-A3B layer's loop backward took several times as long as its forward)."""
    counts = torch.tensor([3, 0, 2, 5, 1, 4, 2, 3])
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    w = torch.randn(8, 24, 16, requires_grad=True)
    out = grouped_mm(x, w, counts, use_grouped=False)
    with WeightSizedTensors(w.shape) as seen:
        out.backward(torch.randn_like(out))
    assert seen.count <= 2, seen.count  # the stacked gradient (and autograd's detach of it)


def test_grouped_mm_supported():
    x, w = torch.randn(4, 16), torch.randn(2, 24, 16)
    assert grouped_mm_supported(x, w)
    assert not grouped_mm_supported(x.bfloat16(), w.bfloat16())  # CPU: fp32 only
    assert not grouped_mm_supported(torch.randn(4, 12), torch.randn(2, 24, 12))
    assert not grouped_mm_supported(x, torch.randn(2, 20, 16))


# ---------------------------------------------------------------------------------------------
# Router


def test_router_probabilities_topk_and_renormalised_weights():
    torch.manual_seed(0)
    router = TokenChoiceRouter(DIM, 8, top_k=3, norm_topk_prob=True)
    router.gate.weight.data.normal_(0, 0.5)
    x = torch.randn(40, DIM)
    probs, experts, weights = router(x, None)
    ref_probs, ref_experts, ref_weights = route_reference(x, router.gate.weight, 3)
    assert probs.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(probs, ref_probs, **reordered_sums(torch.float32, ROUTER_SUMS))
    torch.testing.assert_close(probs.sum(-1), torch.ones(40))
    assert torch.equal(experts.sort(-1).values, ref_experts)
    # Every chosen probability at least every unchosen one.
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(1, experts, True)
    assert (probs.masked_fill(~chosen, 2).min(-1).values >= probs.masked_fill(chosen, -1).max(-1).values).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(40))
    torch.testing.assert_close(weights.gather(-1, experts.argsort(-1)), ref_weights,
                               **reordered_sums(torch.float32, ROUTER_SUMS + 3))  # renormalised over the top k
    torch.testing.assert_close(weights, probs.gather(-1, experts) / probs.gather(-1, experts).sum(-1, keepdim=True),
                               rtol=0, atol=0)


def test_router_without_renormalisation():
    torch.manual_seed(0)
    router = TokenChoiceRouter(DIM, 8, top_k=3, norm_topk_prob=False)
    x = torch.randn(40, DIM)
    probs, experts, weights = router(x, None)
    assert torch.equal(weights, probs.gather(-1, experts))
    assert (weights.sum(-1) < 1 - 1e-3).all()


def test_router_softmax_is_in_fp32_for_bf16_inputs():
    torch.manual_seed(0)
    router = TokenChoiceRouter(DIM, 8, top_k=2, norm_topk_prob=True).bfloat16()
    x = torch.randn(40, DIM).bfloat16()
    probs, _, weights = router(x, None)
    assert probs.dtype == weights.dtype == torch.float32
    logits = router.gate(x)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(probs, torch.softmax(logits.float(), dim=-1))
    assert not torch.equal(probs, torch.softmax(logits, dim=-1).float())  # a bf16 softmax is coarser


def test_router_bias_steers_the_choice_not_the_weights():
    torch.manual_seed(0)
    router = TokenChoiceRouter(DIM, 8, top_k=2, norm_topk_prob=True)
    router.gate.weight.data.normal_(0, 0.5)
    x = torch.randn(40, DIM)
    plain_probs, plain_experts, _ = router(x, None)
    bias = torch.zeros(8)
    bias[5] = 1.0  # probabilities are at most 1: expert 5 is always among the top 2
    probs, experts, weights = router(x, bias)
    assert torch.equal(probs, plain_probs)  # the probabilities do not see the bias
    assert (experts == 5).any(-1).all()
    assert not torch.equal(experts, plain_experts)
    picked = probs.gather(-1, experts)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True), rtol=0, atol=0)
    _, ref_experts, ref_weights = route_reference(x, router.gate.weight, 2, bias=bias)
    assert torch.equal(experts.sort(-1).values, ref_experts)
    torch.testing.assert_close(weights.gather(-1, experts.argsort(-1)), ref_weights,
                               **reordered_sums(torch.float32, ROUTER_SUMS + 3))  # renormalised over the top k


def test_the_expert_bias_steers_the_choice_whatever_the_update_rate():
    # DeepSeek-V3 freezes the bias late in training (rate 0) and keeps using it; a converted
    # checkpoint's e_score_correction_bias likewise steers with the rate at 0.
    x = torch.randn(2, 10, DIM)
    for rate in (0.0, 0.01):
        moe = make_moe(bias_update_rate=rate)
        moe.expert_bias[0] = 1.0
        moe(x)
        counts, _, _ = moe.take_step_stats()
        assert counts[0] == 20, (rate, counts)
        moe.update_expert_bias(counts)
        assert (moe.expert_bias[0] < 1.0) == (rate > 0)  # only a positive rate moves it


# ---------------------------------------------------------------------------------------------
# Dropless routing


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_dropless_output_equals_the_dense_reference_under_unbalanced_routing(top_k, use_grouped_mm):
    moe = make_moe(top_k=top_k)
    moe.experts.use_grouped_mm = use_grouped_mm
    torch.manual_seed(1)
    x = torch.randn(2, 24, DIM)
    with torch.no_grad():  # feature 0 steers every token but two to expert 2
        x[..., 0] = 4.0
        x[0, :2, 0] = -4.0
        moe.router.gate.weight[2, 0] = 3.0
        out = moe(x)
        expected = dense_reference(moe, x)
    counts, _, _ = moe.take_step_stats()
    assert counts[2] == 46 and counts.sum() == 48 * top_k
    assert_reordered(out, expected, LAYER_SUMS)
    assert expected.abs().min(-1).values.gt(1e-3).all()  # no token's output is dropped to zero


# ---------------------------------------------------------------------------------------------
# Auxiliary loss


def train_step(moe, x, g):
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    return out.detach(), grads(moe, x)


def test_aux_loss_coef_zero_adds_nothing():
    torch.manual_seed(1)  # inputs drawn before make_moe seeds: the same ones on every run
    x, g = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    with_zero = make_moe(aux_loss_coef=0.0)
    out_zero, grads_zero = train_step(with_zero, x, g)
    without = make_moe(aux_loss_coef=0.5).eval()  # eval: the aux loss is never computed
    out_none, grads_none = train_step(without, x, g)
    assert torch.equal(out_zero, out_none)
    assert_all_equal(grads_zero, grads_none)
    assert with_zero.take_step_stats()[1] == 0
    # Not vacuous: in training mode the coefficient does change the router's gradient.
    _, grads_aux = train_step(make_moe(aux_loss_coef=0.5), x, g)
    assert not torch.allclose(grads_aux[0], grads_zero[0], atol=1e-4)


def test_aux_loss_gradient_is_exactly_the_formulas():
    coef = 0.5
    torch.manual_seed(1)
    x, g = torch.randn(3, 12, DIM), torch.randn(3, 12, DIM)
    moe = make_moe(aux_loss_coef=coef)
    out, got = train_step(moe, x, g)
    _, aux, _ = moe.take_step_stats()
    # Autograd of main loss + the aux formula, on a copy that adds no aux loss of its own.
    ref = make_moe(aux_loss_coef=0.0)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    aux_ref = aux_reference(ref.router.gate.weight, xr, 2, coef)
    ((out_ref * g).sum() + aux_ref).backward()
    expected = grads(ref, xr)
    assert torch.equal(out, out_ref.detach())  # the model's output is unchanged by the aux loss
    # The aux gradient's sums in another order: over the 36 tokens, then the layer's and the loss's.
    assert_all_close(got, expected, 36 + LAYER_SUMS + AUX_SUMS)
    torch.testing.assert_close(aux, aux_ref.detach(), **reordered_sums(torch.float32, ROUTER_SUMS + AUX_SUMS))
    assert aux > 0.1 * coef  # sum_e f_e P_e is about 1 when balanced
    _, no_aux = train_step(make_moe(aux_loss_coef=0.0), x, g)
    assert (got[0] - no_aux[0]).abs().max() > 1e-3  # the aux part of the router gradient is not negligible


def test_aux_loss_grad_injects_gradient_one():
    x = torch.randn(3, requires_grad=True)
    a = torch.tensor(2.0, requires_grad=True)
    y = AuxLossGrad.apply(x, a * a)
    assert torch.equal(y, x)
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert a.grad == 4.0  # d(a^2)/da x 1


def test_sequences_per_step_spreads_the_loss_over_accumulated_forwards():
    coef = 0.5
    torch.manual_seed(1)
    x, g = torch.randn(4, 8, DIM), torch.randn(4, 8, DIM)
    whole = make_moe(aux_loss_coef=coef)
    _, grads_whole = train_step(whole, x, g)
    _, aux_whole, _ = whole.take_step_stats()
    torch.testing.assert_close(aux_whole, aux_reference(whole.router.gate.weight.detach(), x, 2, coef))

    def accumulate(sequences_per_step):
        moe = make_moe(aux_loss_coef=coef)
        moe.sequences_per_step = sequences_per_step
        xs = x.clone().requires_grad_()
        for half in (slice(0, 2), slice(2, 4)):
            (moe(xs[half]) * g[half]).sum().backward()
        return grads(moe, xs), moe.take_step_stats()

    accumulated, (counts, aux, _) = accumulate(4)
    assert_all_close(accumulated, grads_whole, 32 + LAYER_SUMS + AUX_SUMS)  # 32 tokens in two halves
    torch.testing.assert_close(aux, aux_whole, **reordered_sums(torch.float32, ROUTER_SUMS + AUX_SUMS))
    assert counts.sum() == 4 * 8 * 2
    # Without it each forward averages over its own 2 sequences: twice the aux loss.
    doubled, (_, aux_doubled, _) = accumulate(None)
    torch.testing.assert_close(aux_doubled, 2 * aux_whole, **reordered_sums(torch.float32, ROUTER_SUMS + AUX_SUMS))
    assert (doubled[0] - grads_whole[0]).abs().max() > 1e-3


def test_aux_loss_of_a_sequence_split_across_ranks():
    """Two simulated context-parallel ranks hold the two halves of every sequence: with the other
    half's counts added by `sum_over_sequence_group`, the ranks' aux losses (and router gradients)
    average to those of the whole sequences."""
    coef, seqlen = 0.5, 12
    torch.manual_seed(1)
    x = torch.randn(2, seqlen, DIM)
    whole = make_moe(aux_loss_coef=coef)
    (whole(x) * 0).sum().backward()  # only the aux loss has a gradient
    _, aux_whole, _ = whole.take_step_stats()
    grad_whole = whole.router.gate.weight.grad.clone()

    halves = [x[:, :seqlen // 2], x[:, seqlen // 2:]]
    with torch.no_grad():  # each rank's per-sequence choices, as the other rank would send them

        def sequence_counts(part):
            _, experts, _ = whole.router(part.reshape(-1, DIM), None)
            return F.one_hot(experts.view(2, -1), EXPERTS).sum(1).float()  # (B, E)

        counts = [sequence_counts(h) for h in halves]

    def rank(i, add_other_half=True):
        moe = make_moe(aux_loss_coef=coef)
        moe.sequence_group_size, moe.aux_loss_rank_weight = 2, 2
        if add_other_half:
            moe.sum_over_sequence_group = lambda c, other=counts[1 - i]: c + other
        (moe(halves[i]) * 0).sum().backward()
        return moe.take_step_stats()[1], moe.router.gate.weight.grad.clone()

    (aux_a, grad_a), (aux_b, grad_b) = rank(0), rank(1)
    torch.testing.assert_close((aux_a + aux_b) / 2, aux_whole, **reordered_sums(torch.float32, ROUTER_SUMS + AUX_SUMS))
    assert_reordered((grad_a + grad_b) / 2, grad_whole, 24 + ROUTER_SUMS + AUX_SUMS)  # over the 24 tokens
    assert not torch.allclose(aux_a, aux_b)
    # Without the other half's counts, the average is not the whole sequence's.
    local = (rank(0, False)[0] + rank(1, False)[0]) / 2
    assert (local - aux_whole).abs() > 1e-3


# ---------------------------------------------------------------------------------------------
# Step statistics


def test_tokens_per_expert_counts_k_per_token_and_take_step_stats_resets():
    moe = make_moe(top_k=2, aux_loss_coef=0.1)
    x = torch.randn(3, 10, DIM)
    moe(x)
    moe(x[:1])
    _, experts, _ = route_reference(x.reshape(-1, DIM), moe.router.gate.weight.detach(), 2)
    _, first, _ = route_reference(x[0], moe.router.gate.weight.detach(), 2)
    expected = torch.bincount(experts.flatten(), minlength=EXPERTS) + torch.bincount(first.flatten(), minlength=EXPERTS)
    counts, aux, _ = moe.take_step_stats()
    assert torch.equal(counts, expected.float())
    assert counts.sum() == (30 + 10) * 2
    torch.testing.assert_close(aux, aux_reference(moe.router.gate.weight.detach(), x, 2, 0.1)
                               + aux_reference(moe.router.gate.weight.detach(), x[:1], 2, 0.1))
    counts_after, aux_after, _ = moe.take_step_stats()
    assert not counts_after.any() and aux_after == 0
    assert not moe.tokens_per_expert.any() and moe.aux_loss == 0


def test_activation_checkpointing_counts_tokens_and_aux_once():
    x, g = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    plain = make_moe(aux_loss_coef=0.5)
    out_plain, grads_plain = train_step(plain, x, g)
    stats_plain = plain.take_step_stats()

    checkpointed = make_moe(aux_loss_coef=0.5)
    calls = []
    checkpointed.register_forward_pre_hook(lambda *_: calls.append(1))
    xc = x.clone().requires_grad_()
    out = checkpoint(checkpointed, xc, use_reentrant=False)
    (out * g).sum().backward()
    assert len(calls) == 2  # the forward really was run again in backward
    counts, aux, _ = checkpointed.take_step_stats()
    assert torch.equal(counts, stats_plain[0]) and counts.sum() == 24 * 2
    assert torch.equal(aux, stats_plain[1])
    assert torch.equal(out.detach(), out_plain)
    assert_all_equal(grads(checkpointed, xc), grads_plain)


def test_forwards_flagged_off_count_nothing_but_keep_the_aux_gradient():
    x, g = torch.randn(2, 12, DIM), torch.randn(2, 12, DIM)
    counted = make_moe(aux_loss_coef=0.5)
    _, grads_counted = train_step(counted, x, g)
    flagged = make_moe(aux_loss_coef=0.5)
    flagged.count_step_stats = False  # e.g. a pipeline runtime's shape-probing forward
    _, grads_flagged = train_step(flagged, x, g)
    counts, aux, _ = flagged.take_step_stats()
    assert not counts.any() and aux == 0
    assert_all_equal(grads_flagged, grads_counted)


# ---------------------------------------------------------------------------------------------
# Auxiliary-loss-free bias


def test_update_expert_bias():
    moe = make_moe(bias_update_rate=0.1)
    moe.update_expert_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]), rtol=0, atol=0)
    moe.update_expert_bias(torch.tensor([6, 0, 2, 4]))  # integer counts too
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.2, 0.2, 0.1, -0.1]), rtol=0, atol=1e-7)
    frozen = make_moe(bias_update_rate=0.0)
    frozen.update_expert_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]))
    assert not frozen.expert_bias.any()


# ---------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_identical_forwards_are_bitwise_identical(use_grouped_mm):
    moe = make_moe(aux_loss_coef=0.1)
    moe.experts.use_grouped_mm = use_grouped_mm
    routes = []
    moe.router.register_forward_hook(lambda mod, inp, out: routes.append(out))
    x, g = torch.randn(2, 16, DIM), torch.randn(2, 16, DIM)
    runs = []
    for _ in range(2):
        moe.zero_grad()
        runs.append(train_step(moe, x, g))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_all_equal(runs[0][1], runs[1][1])
    assert_all_equal(routes[0], routes[1])


# ---------------------------------------------------------------------------------------------
# scripts/moe_bench.py


def test_moe_bench_grouped_mm_smoke():
    shapes = [moe_bench.ExpertShape("tiny", dim=16, hidden=24, experts=4, top_k=2, tokens=32),
              moe_bench.ExpertShape("odd", dim=12, hidden=20, experts=3, top_k=1, tokens=8)]
    rows = moe_bench.bench_grouped_mm(shapes, "cpu", reps=1)
    tiny, odd = rows
    assert tiny["grouped_ms"] > 0 and tiny["loop_ms"] > 0 and tiny["speedup"] > 0
    assert tiny["max_diff"] == 0  # fp32 on CPU: the same products
    assert odd["grouped_ms"] is None and odd["loop_ms"] > 0  # dims not multiples of 8: the loop only
    table = moe_bench.format_grouped_mm_table(rows)
    assert "| tiny | cpu | float32 | 16 | 24 | 4 | 2 | 32 | 64 |" in table
    assert "| odd |" in table and "n/a" in table
    assert "grouped_mm" in moe_bench.SECTIONS


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 routing: sigmoid scores, group-limited top-k, routed scaling


def _reference_group_limited(scores, bias, n_group, topk_group, top_k, scale):
    """Token by token, in plain Python: rate each group by its two best biased scores, keep the
    best groups, pick the top-k biased scores among their experts, weight by the raw scores."""
    chosen, weights = [], []
    per_group = scores.shape[1] // n_group
    for s, b in zip(scores.tolist(), [bias.tolist()] * scores.shape[0]):
        biased = [x + y for x, y in zip(s, b)]
        rating = [sum(sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -rating[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        picks = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        w = [s[e] for e in picks]
        chosen.append(sorted(picks))
        weights.append(sorted(x / sum(w) * scale for x in w))
    return chosen, weights


def test_sigmoid_group_limited_routing_equals_a_token_by_token_reference():
    torch.manual_seed(3)
    router = TokenChoiceRouter(DIM, 8, 3, norm_topk_prob=True, score_func="sigmoid", n_group=4, topk_group=2,
                               route_scale=2.5)
    bias = torch.randn(8) * 0.1
    x = torch.randn(40, DIM)
    probs, experts, weights = router(x, bias)
    scores = torch.sigmoid(router.gate(x).float())
    ref_experts, ref_weights = _reference_group_limited(scores, bias, 4, 2, 3, 2.5)
    order = experts.sort(dim=-1)
    assert order.values.tolist() == ref_experts
    torch.testing.assert_close(weights.sort(dim=-1).values, torch.tensor(ref_weights), rtol=1e-6, atol=1e-6)
    # Every token's experts lie in at most topk_group groups.
    assert max(len({e // 2 for e in row}) for row in experts.tolist()) <= 2
    # The balancing loss sees the sigmoid scores normalised per token.
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))


def test_router_refuses_groups_that_cannot_hold_top_k():
    with pytest.raises(ValueError, match="n_group"):
        TokenChoiceRouter(DIM, 8, 2, True, "sigmoid", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="exceeds"):
        TokenChoiceRouter(DIM, 8, 3, True, "sigmoid", n_group=4, topk_group=1)
