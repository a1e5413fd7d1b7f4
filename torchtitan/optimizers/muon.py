"""Muon: momentum orthogonalised by Newton-Schulz, for the matrix parameters (docs/optimizers.md).

Each step keeps an exponential average of the gradient (the momentum), blends it Nesterov-style
with the new gradient, replaces that blend by the nearest semi-orthogonal matrix (five quintic
Newton-Schulz iterations: singular values pushed towards 1, directions kept), and applies it with
a scale that depends only on the matrix's shape, after decoupled weight decay. Everything but the
orthogonalisation is elementwise; the orthogonalisation needs the WHOLE matrix.

Distributed parameters (DTensor: FSDP/HSDP shards, TP shards, experts split by EP) stay sharded
for the elementwise work. Only the update is gathered, and only over the mesh dims that split one
of the last two (matrix) dims; a leading dim (MoE's stacked experts) stays split, each expert is
orthogonalised on its own, and nothing crosses expert-parallel ranks. After the iterations the
update goes back to the parameter's placements, a local slice (Replicate -> Shard). So each step
costs one all-gather of each sharded matrix's update, and the Newton-Schulz flops are repeated by
every rank of the gathering group. Public DTensor APIs only; torch.optim.Muon is 2-D, plain-tensor.

The trainer's non-finite skip (`found_inf`, a 0-dim device tensor, 1.0 = skip) is applied with
torch.where on the device, as the fused AdamW does: no host read.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.optimizers.rounding import RoundingStream, store_rounded
from torchtitan.parallelisms.mixed_precision import resolve_param_dtype
from torchtitan.runtime.torch_compat.composable import bare_name

# Keller Jordan's quintic coefficients (kellerjordan.github.io/posts/muon): the steepest slope at
# zero that still keeps every singular value within about [0.7, 1.2] after five iterations.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
UPDATE_SCALES = ("match_adamw_rms", "original")


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for each matrix of the last two dims of `update`
    (U S V^T its SVD), batched over any leading dims; returned in `update`'s dtype."""
    a, b, c = coefficients
    x = update.to(dtype)
    # Iterate on the wide orientation: the Gram matrix x x^T is then the smaller one.
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Frobenius norm >= spectral norm, so every singular value starts in (0, 1], where the polynomial converges.
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(update.dtype)


def update_scale(shape: torch.Size, rule: str) -> float:
    """Multiplier of the learning rate for a matrix of `shape` (its last two dims: rows, cols).
    match_adamw_rms (Moonlight): 0.2 * sqrt(max(rows, cols)) gives the orthogonal update the RMS of a
    typical AdamW update (0.2-0.4), so AdamW's lr and weight decay carry over. original (Keller
    Jordan): sqrt(max(1, rows / cols))."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_adamw_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown Muon update scale {rule!r}; one of {UPDATE_SCALES}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def whole_matrices(placements: Sequence[Placement], ndim: int) -> list[Placement]:
    """`placements` of a tensor of `ndim` dims with every mesh dim that splits a matrix dim (one of
    the last two) replicated instead; a split of a leading dim (experts) is kept. A split is any
    placement with a `dim`: Shard, and the _StridedShard FSDP puts over TP's Shard of the same dim
    (which is not a Shard subclass and says False to is_shard())."""
    matrix_dims = (ndim - 2, ndim - 1)
    return [Replicate() if getattr(p, "dim", None) is not None and p.dim % ndim in matrix_dims else p
            for p in placements]


def _whole_matrices(param: DTensor) -> list[Placement]:
    return whole_matrices(param.placements, param.ndim)


def _orthogonalize_param(param: torch.Tensor, update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised `update` (this rank's local part of it) for `param`, whole matrices gathered
    over the mesh dims that split them."""
    if not isinstance(param, DTensor):
        return orthogonalize(update, steps, dtype)
    mesh, placements = param.device_mesh, param.placements
    whole = _whole_matrices(param)
    if list(whole) == list(placements):  # every matrix is already whole on this rank
        return orthogonalize(update, steps, dtype)
    shaped = {"shape": param.shape, "stride": param.stride()}  # uneven shards are allowed
    # Gathered in the iterations' dtype: a bf16 Newton-Schulz halves the all-gather too.
    low = DTensor.from_local(update.to(dtype), mesh, placements, run_check=False, **shaped)
    ortho = orthogonalize(low.redistribute(mesh, whole).to_local(), steps, dtype)
    mine = DTensor.from_local(ortho, mesh, whole, run_check=False, **shaped).redistribute(mesh, placements)
    return mine.to_local().to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for parameters of 2 or more dims (the last two a matrix, leading dims a batch of them).

    Per parameter: buf <- momentum * buf + (1 - momentum) * grad; the update is the Nesterov blend
    (1 - momentum) * grad + momentum * buf (or buf itself); O = NS(update); then
    param <- param * (1 - lr * weight_decay) - lr * update_scale(shape) * O.
    Set `found_inf` (a 0-dim tensor on the parameters' device, 1.0 = skip) to make a step a no-op.
    `state_dtype` bfloat16 (optimizer.state_dtype): the momentum is kept in bf16 and updated in fp32,
    stored rounded to nearest or stochastically (optimizers/rounding.py); the steps taken are counted in
    the param groups (`rounding_step`, checkpointed), so the rounding noise resumes exactly.
    """

    def __init__(self, params: Iterable, lr: float, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, scale: str = "match_adamw_rms",
                 ns_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32,
                 stochastic_rounding: bool = False, rounding_stream: RoundingStream | None = None):
        if scale not in UPDATE_SCALES:
            raise ValueError(f"unknown Muon update scale {scale!r}; one of {UPDATE_SCALES}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_steps": ns_steps, "scale": scale, "rounding_step": 0}
        super().__init__(params, defaults)
        self.state_dtype, self.stochastic_rounding = state_dtype, stochastic_rounding
        self.rounding_stream = rounding_stream if rounding_stream is not None else RoundingStream(0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon updates matrices; a parameter of shape {tuple(p.shape)} needs AdamW")
        self.ns_dtype = ns_dtype
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = None if self.found_inf is None else self.found_inf.to(torch.bool)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(p, DTensor) and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                                memory_format=torch.preserve_format)
                elif state["momentum_buffer"].dtype != self.state_dtype:  # loaded from another state dtype
                    state["momentum_buffer"] = state["momentum_buffer"].to(self.state_dtype)
                buf, g, weight = _local(state["momentum_buffer"]), _local(grad), _local(p)
                new_buf = buf.float().lerp(g.float(), 1 - momentum) if buf.dtype != g.dtype else buf.lerp(g, 1 - momentum)
                update = g.lerp(new_buf, momentum) if group["nesterov"] else new_buf
                ortho = _orthogonalize_param(p, update, group["ns_steps"], self.ns_dtype)
                alpha = -lr * update_scale(p.shape, group["scale"])
                new_weight = weight.mul(1 - lr * group["weight_decay"]).add_(ortho, alpha=alpha)
                if skip is not None:  # on the device: a skipped step leaves both as they were, even if not finite
                    new_buf = torch.where(skip, buf, new_buf)
                    new_weight = torch.where(skip, weight, new_weight)
                if buf.dtype == new_buf.dtype:
                    buf.copy_(new_buf)
                else:
                    generator = (self.rounding_stream.generator(buf.device, group["rounding_step"])
                                 if self.stochastic_rounding else None)
                    store_rounded(buf, new_buf, self.stochastic_rounding, generator)
                weight.copy_(new_weight)
            group["rounding_step"] += 1
        return loss


def describe(optimizers: Iterable[torch.optim.Optimizer]) -> dict | None:
    """For the setup record: the matrices this rank's Muon optimizers update, how many of them are
    gathered for their orthogonalisation, and the iterations' dtype; None without Muon."""
    muons = [o for o in optimizers if isinstance(o, Muon)]
    if not muons:
        return None
    params = [p for o in muons for group in o.param_groups for p in group["params"]]
    gathered = sum(isinstance(p, DTensor) and list(_whole_matrices(p)) != list(p.placements) for p in params)
    return {"matrices": len(params), "gathered_matrices": gathered, "ns_dtype": str(muons[0].ns_dtype)}


def excluded(name: str, patterns: Iterable[str]) -> bool:
    """Whether parameter `name` (of the bare model: no wrapper's attribute in it) matches one of
    `patterns`: a name prefix ('output', 'layers.0') or an fnmatch pattern ('*.router.*')."""
    return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)


def check_exclude(job_config: JobConfig, model: nn.Module) -> None:
    """The muon_exclude rule (model phase, on the whole model before it is split or wrapped): each
    pattern must name a parameter, or a typo would silently send what it meant to Muon. The list
    replaces the default one, which the line says when it is not kept."""
    optimizer = job_config.optimizer
    if optimizer.name != "Muon":
        return
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]  # tied weights under each name
    for pattern in optimizer.muon_exclude:
        if not any(excluded(name, (pattern,)) for name in names):
            defaults = [p for p in JobConfig().optimizer.muon_exclude if p not in optimizer.muon_exclude]
            kept = (f"; the list replaces the default, so add {','.join(defaults)} to keep those with AdamW"
                    if defaults else "")
            raise ConfigError(f"optimizer.muon_exclude {pattern!r} matches no parameter of model {job_config.model.name} "
                              f"{job_config.model.flavor} (named like {names[0]}, {names[len(names) // 2]}, {names[-1]}: "
                              f"give a name prefix or an fnmatch pattern){kept}")


@dataclass(frozen=True)
class MuonSplit:
    """Which parameters Muon updates (matrices not excluded by name) and how to build its optimizer."""

    exclude: tuple[str, ...]
    kwargs: dict[str, Any]
    ns_dtype: str  # auto, bfloat16 or float32

    @classmethod
    def from_config(cls, job_config: JobConfig, rounding_stream: RoundingStream | None = None) -> MuonSplit:
        """`rounding_stream`: the job's (shared with a bf16-state AdamW), for optimizer.state_dtype bfloat16."""
        o = job_config.optimizer
        kwargs = {"lr": o.lr, "weight_decay": o.weight_decay, "momentum": o.muon_momentum, "nesterov": o.muon_nesterov,
                  "ns_steps": o.muon_ns_steps, "scale": o.muon_update_scale,
                  "state_dtype": torch.bfloat16 if o.state_dtype == "bfloat16" else torch.float32,
                  "stochastic_rounding": o.state_rounding == "stochastic", "rounding_stream": rounding_stream}
        return cls(tuple(o.muon_exclude), kwargs, o.muon_ns_dtype)

    def takes(self, name: str, param: nn.Parameter) -> bool:
        """Whether Muon updates `param`, named as its model part names it (perhaps through a wrapper)."""
        return param.ndim >= 2 and not excluded(bare_name(name), self.exclude)

    def build(self, params: list[nn.Parameter]) -> Muon:
        device_type = params[0].device.type if params else "cpu"
        # An optimizer with no parameters (a ZeRO-1 replica that owns none) keeps one empty group.
        return Muon(params or [{"params": []}], ns_dtype=resolve_param_dtype(self.ns_dtype, device_type), **self.kwargs)
