"""Mixture-of-experts feed-forward: a token-choice top-k router and stacked SwiGLU experts.

Shared by the model families that have MoE variants (Qwen3-MoE here). Like the rest of the model
code it knows nothing about parallelism or the dry run; they reach it through a few attributes
that default to "one device, real tensors". torchtitan/parallelisms/expert_parallel.py sets:

- `MoE.experts` computes tokens already sorted by expert. Expert parallelism wraps that module so
  the sorted tokens travel to the ranks owning their experts and back (all-to-all), and shards the
  stacked weights by expert; `GroupedExperts` then sees only its rank's experts.
- `MoE.sum_over_sequence_group` adds up per-sequence expert counts over the ranks that hold other
  tokens of the same sequences (context and tensor parallelism), so the load-balancing loss of a
  sequence is the same however its tokens are spread; `sequence_group_size` is that many ranks,
  `aux_loss_rank_weight` how many of them the trainer averages losses over (context parallel).
- `MoE.sequences_per_step` is how many sequences this rank trains on per optimizer step (batch x
  gradient accumulation), so the loss is a mean per sequence over the step whatever the number of
  forwards (accumulation, pipeline microbatches).
- `MoE.capacity_factor` (`moe.capacity_factor`): 0 routes dropless; above 0, the dropping mode.

The dry run (torchtitan/estimation/shapes_only.py) replaces the two that need values, on fake
tensors that have none: `MoE.count_tokens` (tokens per expert of the routing) and `GroupedExperts.kernels`
(which expert matmul runs, and running it).

Routing (`TokenChoiceRouter`): softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3) scores in fp32, the
top k chosen (plus a per-expert bias, zero unless auxiliary-loss-free balancing moved it; the bias
steers the choice only), optionally among the best groups of experts only (DeepSeek-V3's
group-limited routing), the chosen weights renormalised to sum to one when `norm_topk_prob` and
scaled by `route_scale`. Dropless by default: every token reaches all of its k experts, however
unbalanced the routing.

The dropping mode (`capacity_factor` > 0, as GShard / Switch / Megatron's token dropping): each
expert takes at most `cap = ceil(capacity_factor x S x k / E)` (token, choice) pairs from each
sequence of S tokens (S: the tokens of the sequence this rank routes), the earliest positions
first; the others are dropped: their weight is zero, so the token keeps the residual (and whatever
the model adds outside this layer, such as shared experts) and its other choices. Per sequence,
not per batch, so that what is dropped does not depend on how sequences are spread over ranks,
accumulation steps or pipeline microbatches. Per rank each expert's buffer holds B x cap rows for B
sequences, about `capacity_factor x tokens x k / E`. The tokens travel in a padded (E, B x cap, dim)
layout whose sizes are Python ints: the expert matmul, and expert parallelism's all-to-alls, need no
host read of counts (`_capacity_dispatch`).

Load balancing, either or both:
- an auxiliary loss per layer, DeepSeek-V3's sequence-wise form of the standard one:
  coef x sum_e f_e P_e per sequence (f_e: the share of the sequence's k x S choices that went to
  expert e, times E; P_e: its mean router probability), averaged over the step's sequences. Its
  gradient enters backward through `AuxLossGrad`, so the model's output and the trainer's loss stay
  the language-modelling loss; the value is logged.
- DeepSeek-V3's auxiliary-loss-free bias: after each optimizer step, each expert's bias moves by
  `bias_update_rate` towards balance (up when it got fewer tokens than the mean, down when more).
  The trainer does the update (`update_expert_bias`) from counts summed over every rank.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.module_tracker import ModuleTracker

from torchtitan.models.common import trunc_normal
from torchtitan.models.expert_loop_op import expert_matmul_loop

# Asked only whether autograd is running backward (`is_bw`, public), which a tracker answers
# without being entered: it registers no hooks and keeps no state this file reads.
_AUTOGRAD_PHASE = ModuleTracker()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a weight that expert or tensor parallelism made a DTensor (duck-typed,
    so this file needs no torch.distributed); the weight itself on one device. Gradients flow back
    into the DTensor."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def _in_backward() -> bool:
    """True while autograd runs backward: activation checkpointing then re-runs forwards, which
    must not count their tokens a second time. False inside a compiled block: its graph runs the
    statistics' updates in forward only (a checkpoint inside the compiled region recomputes the rest),
    and blocks that a checkpoint wraps from outside keep their MoE layer eager (see
    expert_parallel.moe_compiles_whole)."""
    if torch.compiler.is_compiling():
        return False
    return _AUTOGRAD_PHASE.is_bw


# ---------------------------------------------------------------------------------------------
# Grouped expert matmul


def expert_token_counts(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, choice) pairs each expert receives (`MoE.count_tokens`' default). A sum
    into E slots, not `bincount`, whose output size depends on the largest value: CUDA reads that
    to the host, and dynamo cannot trace it into a graph."""
    counts = torch.zeros(num_experts, dtype=flat_experts.dtype, device=flat_experts.device)
    return counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))


@torch.compiler.assume_constant_result
def _cuda_major_version(device: torch.device) -> int:
    """The device's compute capability major version; a constant to torch.compile, which asks it while
    tracing a compiled MoE block instead of tracing the device query."""
    return torch.cuda.get_device_capability(device)[0]


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` runs these operands on their device: CUDA from compute
    capability 9.0 (bf16), CPU in fp32 outside torch.compile (its bf16 backward fails on CPU);
    every feature dim a multiple of 8 (16-byte rows in bf16)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if any(d % 8 for w in weights for d in w.shape[1:]) or x.shape[-1] % 8:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and _cuda_major_version(x.device) >= 9
    # Under torch.compile the operator's shape function accepts bf16 only (PyTorch 2.13).
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor | int | list[int],
               use_grouped: bool) -> torch.Tensor:
    """Rows of x (N, in), grouped by expert in order (`counts[e]` rows for expert e), each times its
    expert's weight.T (weight: (E, out, in), the nn.Linear layout) -> (N, out).

    `use_grouped`: one `F.grouped_mm` call; otherwise a loop of one matmul per expert (the
    exact fallback: the same products, one group at a time).

    `counts` a Python int: every expert has that many rows (the dropping mode's padded layout,
    `MoE.capacity_factor`). The group sizes are then known without reading a tensor: the offsets
    are made on the device, and the fallback is one batched matmul instead of the loop.

    `counts` a list: the loop's split sizes, already read to the host (`GroupedExperts` reads them
    once for its three matmuls). A tensor: the loop reads it; inside torch.compile the loop runs as
    one custom operator (torchtitan/models/expert_loop_op.py), which reads it again in backward.
    `F.grouped_mm` and the int form read nothing."""
    if isinstance(counts, int):
        if use_grouped:
            offsets = torch.arange(1, weight.shape[0] + 1, device=x.device, dtype=torch.int32) * counts
            return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        return torch.bmm(x.view(weight.shape[0], counts, -1), weight.transpose(-2, -1)).flatten(0, 1)
    if use_grouped:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    # split / unbind / cat, not `weight[e]` and writes into a buffer: their backward gathers the
    # groups' gradients once, where each `weight[e]` (and each slice) would materialise a zero
    # gradient the size of the whole stacked weight, E of them per backward.
    if isinstance(counts, torch.Tensor) and torch.compiler.is_compiling():
        return expert_matmul_loop(x, weight, counts)
    groups = zip(x.split(counts if isinstance(counts, list) else counts.tolist()), weight.unbind(0))
    return torch.cat([xe @ we.T for xe, we in groups])


class ExpertKernels(NamedTuple):
    """How `GroupedExperts` multiplies: `supported(x, *weights)` says whether the grouped kernel runs
    these operands, `matmul(x, weight, counts, use_grouped)` runs one grouped matmul either way."""

    supported: Callable[..., bool]
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | int | list[int], bool], torch.Tensor]


DEVICE_KERNELS = ExpertKernels(grouped_mm_supported, grouped_mm)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w1, w3 (E, hidden, dim) and w2 (E, dim, hidden).

    Stacked rather than E separate modules so that one grouped matmul computes every expert, and
    so that expert parallelism can shard them by expert (dim 0) as one tensor, with names that do
    not depend on the layout (`moe.experts.w1`, whatever rank holds which experts).

    gpt-oss's experts add two things (off by default): `bias`, one bias per expert for each of the
    three projections (b1, b3 (E, hidden), b2 (E, dim); stacked and sharded by expert like the
    weights), and `swiglu_limit`, its clamped SwiGLU: the gate clamped from above and the linear
    part on both sides at the limit, then gate x sigmoid(`swiglu_alpha` x gate) x (up + 1)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, bias: bool = False,
                 swiglu_limit: float = 0.0, swiglu_alpha: float = 1.0):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        else:
            self.b1 = self.b2 = self.b3 = None
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha  # limit 0: the plain SwiGLU
        # None: F.grouped_mm where `kernels.supported` says so; False: always the loop.
        self.use_grouped_mm: bool | None = None
        self.kernels = DEVICE_KERNELS  # a seam (module docstring): the dry run's differ
        # The rank's own part of a stacked weight: a seam, duck-typed by default; expert parallelism,
        # whose weights are DTensors, sets the DTensor method itself, which torch.compile traces (it
        # answers a getattr on a DTensor parameter as on a plain tensor).
        self.local: Callable[[torch.Tensor], torch.Tensor] = _local

    def init_weights(self, init_std: float) -> None:
        trunc_normal(self.w1, 0.02)
        trunc_normal(self.w2, init_std)
        trunc_normal(self.w3, init_std)
        for bias in (self.b1, self.b2, self.b3):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | int) -> torch.Tensor:
        """x (N, dim): tokens sorted by expert, `counts` (E_local,) per expert -> (N, dim); or
        `counts` a Python int, the rows of every expert (the dropping mode's padded layout)."""
        w1, w2, w3 = self.local(self.w1), self.local(self.w2), self.local(self.w3)
        if torch.is_autocast_enabled(x.device.type):
            # The grouped matmul has no autocast rule: cast its operands as autocast casts any matmul.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = x.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
        grouped = self.use_grouped_mm is not False and self.kernels.supported(x, w1, w2, w3)
        rows_expert = self._row_experts(counts, w1.shape[0], x) if self.b1 is not None else None
        if isinstance(counts, torch.Tensor) and not grouped and not torch.compiler.is_compiling():
            counts = counts.tolist()  # the loop's split sizes, read once for the three matmuls
        matmul = self.kernels.matmul
        gate, up = matmul(x, w1, counts, grouped), matmul(x, w3, counts, grouped)
        if rows_expert is not None:
            gate, up = gate + self._bias_rows(self.b1, rows_expert, gate), up + self._bias_rows(self.b3, rows_expert, up)
        if self.swiglu_limit > 0:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            h = gate * torch.sigmoid(gate * self.swiglu_alpha) * (up + 1)
        else:
            h = F.silu(gate) * up
        out = matmul(h, w2, counts, grouped)
        return out if rows_expert is None else out + self._bias_rows(self.b2, rows_expert, out)

    @staticmethod
    def _row_experts(counts: torch.Tensor | int, local_experts: int, x: torch.Tensor) -> torch.Tensor:
        """(N,) the local expert of each sorted row, made on the device: `output_size` keeps the
        repeat from reading the counts to the host."""
        experts = torch.arange(local_experts, device=x.device)
        if isinstance(counts, int):
            return experts.repeat_interleave(counts)
        return experts.repeat_interleave(counts, output_size=x.shape[0])

    def _bias_rows(self, bias: torch.Tensor, rows_expert: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.local(bias).to(like.dtype)[rows_expert]


# ---------------------------------------------------------------------------------------------
# Router and the MoE layer


class TokenChoiceRouter(nn.Module):
    """Each token's top-k experts and their weights.

    `score_func`: "softmax" (Qwen3-MoE, DeepSeek-V2) turns the gate's logits into probabilities over
    the experts; "sigmoid" (DeepSeek-V3) scores each expert on its own. `n_group` / `topk_group`:
    group-limited routing (DeepSeek-V3's node-limited routing): the experts form `n_group` equal
    groups, each group is rated by the sum of its two best scores (its best one when a group holds a
    single expert), and a token may choose only among the experts of its `topk_group` best groups,
    which bounds how many nodes its tokens travel to when groups map to nodes. The bias
    (auxiliary-loss-free balancing, and DeepSeek-V3's imported correction bias) steers the choice
    only, never the weights. `route_scale` multiplies the chosen weights (DeepSeek-V3's routed
    scaling factor)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool, score_func: str = "softmax",
                 n_group: int = 1, topk_group: int = 1, route_scale: float = 1.0, gate_bias: bool = False):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be softmax or sigmoid, got {score_func!r}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"group-limited routing needs n_group ({n_group}) dividing the {num_experts} experts and "
                             f"1 <= topk_group ({topk_group}) <= n_group")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * (num_experts // n_group)} experts of "
                             f"{topk_group} groups of {num_experts // n_group}")
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)  # gpt-oss's router has a bias
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.score_func, self.n_group, self.topk_group, self.route_scale = score_func, n_group, topk_group, route_scale

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> probabilities (T, E) fp32 (sigmoid scores normalised per token, as the
        balancing loss wants them), chosen experts (T, k) and their weights (T, k)."""
        logits = self.gate(x).float()
        scores = F.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        choose_by = scores if bias is None else scores + bias
        if self.n_group > 1:
            choose_by = self._limit_to_groups(choose_by)
        experts = torch.topk(choose_by, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.score_func == "softmax":
            probs = scores
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            probs = scores / scores.sum(dim=-1, keepdim=True)
            if self.norm_topk_prob:  # (the epsilon: sigmoid scores can all underflow to zero)
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return probs, experts, weights

    def _limit_to_groups(self, choose_by: torch.Tensor) -> torch.Tensor:
        """`choose_by` with the experts outside each token's `topk_group` best groups set to -inf."""
        tokens, n_experts = choose_by.shape
        grouped = choose_by.view(tokens, self.n_group, n_experts // self.n_group)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (T, n_group)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, n_experts)


class AuxLossGrad(torch.autograd.Function):
    """Returns `x` unchanged; in backward gives `aux` the gradient 1 (as if it were added to the
    loss) and passes x's gradient through. Lets a layer add a loss term without changing what the
    model returns, on every pipeline stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class StepStats(NamedTuple):
    """What `MoE.take_step_stats` hands the trainer: this rank's share of the step."""

    tokens_per_expert: torch.Tensor  # (E,) routed (token, choice) pairs per expert, dropped ones included
    aux_loss: torch.Tensor  # () the auxiliary loss
    dropped_tokens: torch.Tensor  # () (token, choice) pairs the dropping mode dropped (0 when dropless)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0, score_func: str = "softmax",
                 n_group: int = 1, topk_group: int = 1, route_scale: float = 1.0, capacity_factor: float = 0.0,
                 linear_biases: bool = False, swiglu_limit: float = 0.0, swiglu_alpha: float = 1.0):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        self.capacity_factor = capacity_factor  # 0: dropless (module docstring)
        self.router = TokenChoiceRouter(dim, num_experts, top_k, norm_topk_prob, score_func, n_group, topk_group,
                                        route_scale, gate_bias=linear_biases)
        # gpt-oss: the router and every expert projection have biases, and the experts clamp their SwiGLU.
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, linear_biases, swiglu_limit, swiglu_alpha)
        # Auxiliary-loss-free balancing state: saved in checkpoints, updated by the trainer.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        # This step's routed tokens per expert and auxiliary loss (this rank's share), for the
        # bias update and the metrics; reset by `take_step_stats`.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(()), persistent=False)
        # Parallelism and training seams (module docstring); these defaults are one device.
        self.sum_over_sequence_group: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.sequence_group_size = 1
        self.aux_loss_rank_weight = 1
        self.sequences_per_step: int | None = None
        self.count_step_stats = True
        # Tokens per expert from the chosen experts (T*k,): a seam (module docstring).
        self.count_tokens: Callable[[torch.Tensor, int], torch.Tensor] = expert_token_counts

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        trunc_normal(self.router.gate.weight, 0.02)
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        self.experts.init_weights(init_std)
        device = buffer_device or self.expert_bias.device
        self.expert_bias = torch.zeros(self.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)
        self.aux_loss = torch.zeros((), device=device)
        self.dropped_tokens = torch.zeros((), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        # The bias is zero unless balancing moved it or a converted checkpoint brought one (DeepSeek-V3's
        # e_score_correction_bias); a zero bias chooses exactly as none would.
        probs, experts, weights = self.router(tokens, self.expert_bias)
        dropped = None
        if self.capacity_factor > 0:
            combined, counts, dropped = self._capacity_dispatch(tokens, experts, weights, bsz)
        else:
            flat_experts = experts.flatten()  # (T*k,), token t's choices at t*k ... t*k+k-1
            counts = self.count_tokens(flat_experts, self.num_experts)
            # Sort the (token, choice) pairs by expert; stable, so each expert sees its tokens in order.
            order = torch.argsort(flat_experts, stable=True)
            routed = tokens[order // self.top_k]
            out = self.experts(routed, counts)
            # Unsort, then add each token's k outputs, in a fixed order: deterministic on every device,
            # unlike a scatter-add.
            unsorted = torch.empty_like(out)
            unsorted[order] = out
            combined = (unsorted.view(-1, self.top_k, dim) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        # Statistics count each forward once: not again when activation checkpointing re-runs it
        # in backward, nor in forwards a runtime flags off (a pipeline's shape-probing pass).
        # The same ops run either way (adding zero when not counting): op-level activation
        # checkpointing matches the ops of the re-run to those of the forward.
        counting = float(self.count_step_stats and not _in_backward())
        # add_, not +=, whose re-assignment of the buffer dynamo refuses inside a compiled checkpoint.
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype) * counting)
            if dropped is not None:
                self.dropped_tokens.add_(dropped.to(self.dropped_tokens.dtype) * counting)
        if self.aux_loss_coef > 0 and self.training:
            aux = self._sequence_balance_loss(probs.view(bsz, seqlen, -1), experts.view(bsz, seqlen, -1))
            with torch.no_grad():  # (a where, not a product: a flagged-off forward may see garbage, even NaN)
                # The flag is made on the device: a host tensor would be copied there with a blocking copy.
                self.aux_loss.add_(torch.where(torch.full((), counting > 0, device=aux.device), aux.detach(), 0.0))
            combined = AuxLossGrad.apply(combined, aux)
        return combined.view(bsz, seqlen, dim)

    def capacity(self, seqlen_local: int) -> int:
        """(token, choice) pairs each expert takes from each sequence of `seqlen_local` tokens in the
        dropping mode: ceil(capacity_factor x S x k / E), at most S (a token picks an expert once)."""
        return min(math.ceil(self.capacity_factor * seqlen_local * self.top_k / self.num_experts), seqlen_local)

    def _capacity_dispatch(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                           bsz: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dropping mode's experts (module docstring): tokens (B*S, dim), chosen experts and
        weights (B*S, k) -> combined outputs (B*S, dim), routed pairs per expert (E,) and the number
        dropped (). Every shape is fixed by B, S, k, E and the capacity; nothing is read to the host.
        In three calls: the placement into the padded buffer, the experts, the read-back. The first
        and the last are pure functions of their tensors, so a layout that keeps the experts module
        out of a compiled graph (expert parallelism: expert_parallel.compile_moe_parts) can compile
        them on their own."""
        cap = self.capacity(tokens.shape[0] // bsz)
        routed, slot, kept, counts = self.capacity_place(tokens, experts, bsz)
        out = self.experts(routed, bsz * cap)  # (E * B * cap, dim)
        return self.capacity_combine(out, slot, kept, weights), counts, kept.numel() - kept.sum()

    def capacity_place(self, tokens: torch.Tensor, experts: torch.Tensor,
                       bsz: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dropping mode's placement: the padded buffer routed to the experts (E * B * cap, dim),
        each pair's slot in it and whether it was kept (B*S*k,), and the pairs routed to each expert
        (E,), dropped ones included."""
        n_experts, k = self.num_experts, self.top_k
        seqlen = tokens.shape[0] // bsz
        cap = self.capacity(seqlen)
        n_pairs = tokens.shape[0] * k
        device = tokens.device
        # Group the (token, choice) pairs by (expert, sequence): a stable sort keeps each group in
        # position order, and the groups in the order of the padded buffer (expert-major).
        sequence = torch.arange(n_pairs, device=device) // (seqlen * k)
        group = experts.flatten() * bsz + sequence  # pairs in token order: (b, s, choice)
        order = torch.argsort(group, stable=True)
        groups = torch.arange(n_experts * bsz, device=device)
        sorted_group = group[order]
        starts = torch.searchsorted(sorted_group, groups)
        sizes = torch.searchsorted(sorted_group, groups, right=True) - starts  # (E*B,)
        # Each pair's place in its group (0 = the earliest position); beyond cap it is dropped.
        place = torch.empty_like(order)
        place[order] = torch.arange(n_pairs, device=device) - starts[sorted_group]
        kept = place < cap
        # The buffer: slot c of group g holds the group's c-th pair, or zeros where the group has fewer.
        slots = torch.arange(cap, device=device)
        source = (starts.unsqueeze(1) + slots).clamp(max=n_pairs - 1)  # (E*B, cap) index into the sorted pairs
        filled = (slots < sizes.unsqueeze(1)).flatten().unsqueeze(-1)
        routed = torch.where(filled, tokens[order[source.flatten()] // k], 0)
        # Each pair's slot in the experts' output (a dropped pair any slot: its weight is zero).
        slot = torch.where(kept, group * cap + place, 0)
        return routed, slot, kept, sizes.view(n_experts, bsz).sum(dim=1)

    def capacity_combine(self, out: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        """The dropping mode's read-back: each pair reads its slot of the experts' output, and each
        token adds its k outputs in a fixed order, as dropless does -> (B*S, dim)."""
        picked = out[slot].view(-1, self.top_k, out.shape[-1])
        kept_weights = weights * kept.view_as(weights)
        return (picked * kept_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _sequence_balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's share of coef x mean over the step's sequences of sum_e f_e P_e (module
        docstring), for probs (B, S_local, E) and chosen experts (B, S_local, k)."""
        bsz, seqlen_local, n_experts = probs.shape
        seqlen = seqlen_local * self.sequence_group_size  # each sequence's full length
        with torch.no_grad():
            counts = torch.zeros(bsz, n_experts, device=probs.device)
            counts.scatter_add_(1, experts.flatten(1), torch.ones_like(experts.flatten(1), dtype=counts.dtype))
            counts = self.sum_over_sequence_group(counts)  # the whole sequence's choices
            f = counts * n_experts / (self.top_k * seqlen)
        partial_p = probs.sum(dim=1) / seqlen  # this rank's tokens' share of each sequence's mean probability
        per_sequence = (f * partial_p).sum(dim=-1)
        sequences = self.sequences_per_step or bsz
        return self.aux_loss_coef * self.aux_loss_rank_weight * per_sequence.sum() / sequences

    def take_step_stats(self) -> StepStats:
        """(tokens per expert, auxiliary loss, dropped pairs) accumulated since the last call, then reset."""
        stats = StepStats(self.tokens_per_expert.clone(), self.aux_loss.clone(), self.dropped_tokens.clone())
        self.tokens_per_expert.zero_()
        self.aux_loss.zero_()
        self.dropped_tokens.zero_()
        return stats

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: `tokens_per_expert` summed over every rank."""
        if self.bias_update_rate <= 0:
            return
        mean = tokens_per_expert.float().mean()
        self.expert_bias += self.bias_update_rate * torch.sign(mean - tokens_per_expert.float())
