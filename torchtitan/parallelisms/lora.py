"""LoRA in a parallel model: adapters added to the linear layers a job names, laid out like their
base, the rest of the model frozen; the adapters' initial values, the same under every layout;
the checks of lora.target_modules against the model (docs/lora.md).

Each family's parallelize function calls `apply_lora` right after tensor parallelism (and float8,
which LoRA refuses) and before activation checkpointing, torch.compile and FSDP/DDP, which then
wrap the adapted blocks as any other; with pipeline parallelism each stage is parallelized through
the same function. Under TP the adapters follow the base layer's split: for a column-wise base
(weight Shard(0), output features split) `lora_a` is whole on every rank and `lora_b` is split like
the base's rows, so each rank's adapter output is its own slice of the features; for a row-wise
base (weight Shard(1), input features split) `lora_a` is split by its input columns and `lora_b` is
whole, so each rank's adapter output is a partial sum that the base's own reduction adds up with
the base's partial sums. A base kept whole on every tp rank (DeepSeek-V3's latent compressions)
keeps its adapters whole too.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from torchtitan.config.job_config import JobConfig, LoRA
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.lora_linear import (
    ALL_LINEAR,
    add_adapters,
    block_part,
    expert_weights,
    is_adapted,
    is_adapter_name,
    linear_layers,
    matches,
    reset_adapters,
    select_targets,
)

logger = logging.getLogger(__name__)


def apply_lora(model: nn.Module, lora: LoRA) -> None:
    """Adds adapters to the layers lora.target_modules names (laid out like their base under TP)
    and freezes every other parameter. Nothing with lora.rank 0."""
    if lora.rank == 0:
        return
    targets = select_targets(model, lora.target_modules)
    for name, linear in targets.items():
        add_adapters(linear, name, lora.rank, lora.alpha, lora.dropout)
        if isinstance(linear.weight, DTensor):
            _lay_out_like_base(linear)
    # The base is frozen: no gradients, no optimizer state; the optimizer takes trainable parameters only.
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(f"applied LoRA (rank {lora.rank}, alpha {lora.alpha:g}) to {len(targets)} linear layers: "
                f"{trainable:,} trainable of {total:,} parameters, the rest frozen")


def adapter_placements(base: tuple[Placement, ...]) -> tuple[list[Placement], list[Placement]]:
    """(lora_a's, lora_b's) placements for a base weight (out, in) of placements `base`, per mesh dim."""
    a, b = [], []
    for p in base:
        if isinstance(p, Shard) and p.dim == 0:  # column-wise: output features split
            a.append(Replicate())
            b.append(Shard(0))
        elif isinstance(p, Shard) and p.dim == 1:  # row-wise: input features split, output a partial sum
            a.append(Shard(1))
            b.append(Replicate())
        else:
            a.append(Replicate())
            b.append(Replicate())
    return a, b


def _lay_out_like_base(linear: nn.Linear) -> None:
    mesh, placements = linear.weight.device_mesh, linear.weight.placements
    a, b = adapter_placements(placements)
    for module, layout in ((linear.lora_a, a), (linear.lora_b, b)):
        # On the meta device nothing is communicated (src_data_rank None: each rank takes its own piece).
        module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, layout, src_data_rank=None))


def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator of its own per adapted layer: its values do not depend on which layers a
    rank or pipeline stage holds, nor on the order they are initialised in."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _fill(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copies this rank's piece of the whole tensor `whole` into `param` (plain or DTensor)."""
    if isinstance(param, DTensor):
        piece = distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(piece.to_local())
    else:
        param.copy_(whole)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """The adapters' initial values, the same under every layout: each layer's A is drawn whole on
    the CPU from a generator seeded by the run's seed and the layer's name, then each rank keeps its
    piece (a sharded CPU init would draw every shard from one stream: docs/parity.md); B is zero.
    Called after `init_weights`, when the parameters have their storage."""
    for module in model.modules():
        if not is_adapted(module):
            continue
        a, b = module.lora_a.weight, module.lora_b.weight
        whole_a = torch.empty(a.shape, dtype=a.dtype)
        whole_b = torch.empty(b.shape, dtype=b.dtype)
        reset_adapters(whole_a, whole_b, _generator(seed, module.lora_name))
        _fill(a, whole_a)
        _fill(b, whole_b)


def check_targets(job_config: JobConfig, model: nn.Module) -> None:
    """The model rule of lora.target_modules, on the whole model on the meta device before any
    process group: every pattern names a linear layer, none names routed experts or a tied output
    projection, and lora.rank fits every adapted layer."""
    lora = job_config.lora
    if lora.rank == 0:
        return
    name = f"model {job_config.model.name}"
    layers = linear_layers(model)
    for pattern in lora.target_modules:
        if pattern == ALL_LINEAR or any(matches(pattern, n) for n in layers):
            continue
        experts = [w for w in expert_weights(model) if matches(pattern, w) or matches(pattern, w.rsplit(".", 1)[0])]
        if experts:
            raise ConfigError(f"lora.target_modules {pattern!r} names the routed experts of {name} ({experts[0]}), whose "
                              "weights are grouped 3-D tensors: LoRA adapts linear layers only; target the attention "
                              "and shared-expert layers (e.g. all-linear)")
        known = ", ".join(dict.fromkeys(block_part(n) for n in layers))
        raise ConfigError(f"lora.target_modules {pattern!r} matches no linear layer of {name} (its linear layers: "
                          f"{known})")
    targets = select_targets(model, lora.target_modules)
    names: dict[int, list[str]] = {}
    for param_name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(param_name.removesuffix(".weight"))
    for layer, linear in targets.items():
        others = [n for n in names.get(id(linear.weight), []) if n != layer]
        if others:  # a tied weight (the output projection and the embedding of a tied flavor)
            raise ConfigError(f"lora.target_modules names {layer}, which {name} {job_config.model.flavor} ties to "
                              f"{others[0]}: a merged adapter would change {others[0]} too; leave {layer} out")
    for layer, linear in targets.items():
        out_features, in_features = linear.weight.shape
        if lora.rank > min(out_features, in_features):
            raise ConfigError(f"lora.rank {lora.rank} is above what {layer} of {name} {job_config.model.flavor} can "
                              f"use ({in_features} inputs, {out_features} outputs): a rank of at most "
                              f"{min(out_features, in_features)} for it, or leave it out of lora.target_modules")
