"""Adam/AdamW whose two moments are stored in bf16 (optimizer.state_dtype = "bfloat16").

Each step loads a moment, upcasts it, updates it and computes the parameter's step in fp32, then
writes the moment back rounded (optimizers/rounding.py: to nearest, or stochastically). That halves
the optimizer state (8 -> 4 bytes per parameter) while the parameters stay fp32 master weights.
torch's fused and foreach kernels need the state in the parameter's dtype, hence this step of our
own: per tensor, in chunks, so the fp32 temporaries stay bounded (about 5 x 4 bytes x _CHUNK).

Matches torch.optim.Adam/AdamW's update (decoupled weight decay for AdamW, L2 for Adam; the bias
corrections; eps outside the square root), its state dict (step, exp_avg, exp_avg_sq; the same
param-group keys), so checkpoints move between fp32 and bf16 state (moments cast on load), and its
`found_inf` skip: set by the container as a 0-dim device tensor, 1.0 skips the update on the device
(nothing read on the host) and rolls the step count back, as torch's fused kernels do.
DTensor parameters (FSDP/TP shards) are updated through their local tensors; the moments are
DTensors of the parameter's placements, so distributed checkpoints reshard them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan.optimizers.rounding import RoundingStream, store_rounded

# Elements updated at once; larger local tensors go through their flat view in pieces.
_CHUNK = 1 << 24


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _pieces(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The same pieces of each (equal-sized) tensor: flat chunks when all are contiguous."""
    if not all(t.is_contiguous() for t in tensors):
        return [tensors]
    return list(zip(*(t.view(-1).split(_CHUNK) for t in tensors)))


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) or, with decoupled_weight_decay, AdamW, with moments in `state_dtype`.

    `fused` and `foreach` are accepted and kept in the param groups only so the groups (and so the
    checkpoints) carry the same keys as torch's; this step is the same either way.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False, *,
                 state_dtype: torch.dtype = torch.bfloat16, stochastic_rounding: bool = False,
                 rounding_stream: RoundingStream | None = None, fused: bool | None = None, foreach: bool | None = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, capturable=False, differentiable=False, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        if stochastic_rounding and state_dtype != torch.bfloat16:
            raise ValueError(f"stochastic rounding stores bf16; the state dtype is {state_dtype}")
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.rounding_stream = rounding_stream if rounding_stream is not None else RoundingStream(0)
        # Steps taken (skipped ones too), counted on the host: each step's rounding noise is drawn
        # from (seed, count), so a run repeats and a resumed one continues the same stream.
        self.rounding_calls = 0
        self.register_load_state_dict_post_hook(LowPrecisionAdam._after_load)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            # The step count lives on the parameter's device (as in torch's fused path) so the
            # bias corrections and the found_inf roll-back never need the host.
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            # zeros_like of a DTensor keeps its mesh and placements (uneven shards included).
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rounding_calls += 1
        found_inf = getattr(self, "found_inf", None)  # the container's skip flag, or None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, found_inf)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], found_inf: torch.Tensor | None) -> None:
        state = self._init_state(p)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        decoupled = group["decoupled_weight_decay"]
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            # A gradient laid out otherwise than its parameter (met under TP): to the parameter's
            # layout, as DTensor's dispatch does for torch's kernels.
            grad = grad.redistribute(p.device_mesh, p.placements)
        param, grad = _local(p), _local(grad)
        exp_avg, exp_avg_sq, step = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"]
        step.add_(1)
        # Device scalars: the step count is on the device. A skipped step (found_inf 1.0) must leave
        # everything exactly as it was, so its gradient is zeroed and its weights made 0 or 1 (never
        # multiplied in: 0 x inf would be NaN).
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
        neg_step_size = -lr / bias_correction1
        decay, weight1, beta2_now = 1 - lr * wd, 1 - beta1, beta2
        skip = None
        if found_inf is not None:
            skip = found_inf.to(param.device, non_blocking=True) > 0
            keep = (~skip).to(torch.float32)
            neg_step_size, weight1 = neg_step_size * keep, weight1 * keep
            decay = torch.where(skip, 1.0, decay)
            beta2_now = torch.where(skip, 1.0, beta2)
        generator = self.rounding_stream.generator(param.device, self.rounding_calls) if self.stochastic_rounding else None
        for piece_p, piece_g, piece_m, piece_v in _pieces(param, grad, exp_avg, exp_avg_sq):
            g = piece_g.float()
            if wd != 0 and not decoupled:
                g = g.add(piece_p, alpha=wd)  # Adam's L2 term joins the gradient
            if skip is not None:
                g = torch.where(skip, 0.0, g)
            if wd != 0 and decoupled:
                piece_p.mul_(decay)
            m, v = piece_m.float(), piece_v.float()
            m.lerp_(g, weight1)
            v.mul_(beta2_now).addcmul_(g, g, value=1 - beta2)
            del g
            update = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
            torch.div(m, update, out=update)
            piece_p.add_(update.mul_(neg_step_size))
            del update
            store_rounded(piece_m, m, self.stochastic_rounding, generator)
            store_rounded(piece_v, v, self.stochastic_rounding, generator)
        if found_inf is not None:
            step.sub_(found_inf.to(step.device, non_blocking=True))

    def _after_load(self) -> None:
        """torch's load casts every state tensor to the parameter's dtype (fp32): back to the state's
        dtype, the step count to the device, and the rounding stream to where the run was."""
        for p, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(dtype=self.state_dtype)
            if "step" in state:
                state["step"] = state["step"].to(dtype=torch.float32, device=_local(p).device)
        steps = [state["step"] for state in self.state.values() if "step" in state]
        if self.stochastic_rounding and steps:
            # One host read at load time (not in a step). A run that skipped steps counted more
            # calls than this; it then continues from another (equally good) point of the stream.
            self.rounding_calls = int(steps[0].item())
            self.rounding_stream.restart()
