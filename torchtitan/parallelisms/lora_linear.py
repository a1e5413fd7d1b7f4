"""LoRA (low-rank adaptation): trainable low-rank adapters beside a frozen linear layer, in plain
single-device PyTorch.

A linear layer `y = x W^T` gets two small linear layers, `lora_a` (rank x in) and `lora_b`
(out x rank), and computes `y = x W^T + (alpha / rank) * lora_b(lora_a(dropout(x)))`. `lora_b`
starts at zero, so an adapted model computes exactly what its base does until it trains. The
adapters are children of the linear layer itself: the base weight keeps its name (`<linear>.weight`,
so checkpoints and the Hugging Face conversion see the model they always saw) and the adapters are
`<linear>.lora_a.weight` and `<linear>.lora_b.weight`.

The layer keeps its object and its hooks: its class is swapped for a generated subclass whose
`forward` adds the adapters' path (as FSDP2's `fully_shard` swaps classes). Tensor parallelism
therefore still converts the layer's input and output around that forward, and the adapters'
path runs where the base's does, on the same kind of tensors (parallelisms/lora.py lays the
adapters out to match). Which layers are adapted is decided by name (`select_targets`), as every
parallelism here reaches the model. The file sits beside the other modules installed into a model
from outside (the chunked loss head): the model files know nothing of LoRA.
"""

from __future__ import annotations

import fnmatch
import math
import re

import torch
from torch import nn

ADAPTERS = ("lora_a", "lora_b")
# peft's name for "every linear layer of the blocks"; the default target.
ALL_LINEAR = "all-linear"
# What all-linear covers: linear layers inside a transformer block (the main blocks, and
# DeepSeek-V3's MTP blocks), routers excepted: a router's few outputs decide which experts run.
_IN_BLOCK = re.compile(r"^(layers\.\d+|mtp\.\d+\.block)\.")


class LoRALinear:
    """Mixed into a linear layer's own class (`add_adapters`): the base's forward plus the adapters'."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float
    lora_name: str  # the layer's name in the whole model: its adapters' initial values are drawn from it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    """One generated subclass per linear class (nn.Linear, or a subclass of it), made once."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinear, cls), {})
    return _CLASSES[cls]


def is_adapted(module: nn.Module) -> bool:
    return isinstance(module, LoRALinear)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter's (`...lora_a.weight`, `...lora_b.weight`)."""
    return any(f".{adapter}." in f".{name}" for adapter in ADAPTERS)


def add_adapters(linear: nn.Linear, name: str, rank: int, alpha: float, dropout: float) -> None:
    """Gives `linear` (named `name` in the whole model) adapters of `rank`, in fp32 on its device
    (the meta device before materialisation). Their values are set by `reset_adapters`."""
    device = linear.weight.device
    out_features, in_features = linear.weight.shape
    # fp32 whatever the base's dtype: the optimizer updates them, and bf16 would round small updates away.
    linear.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=torch.float32)
    linear.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=torch.float32)
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.lora_scale = alpha / rank
    linear.lora_name = name
    linear.__class__ = _adapted_class(type(linear))


def reset_adapters(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """peft's initialisation: A as nn.Linear's own (Kaiming-uniform with a = sqrt(5)), B zeros, so
    the adapted layer starts as its base."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(b)


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32 (the base's dtype on return): the export's merged weight."""
    merged = weight.float() + scale * (b.float() @ a.float())
    return merged.to(weight.dtype)


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every linear layer of `model` by name, adapters aside."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in ADAPTERS}


def matches(pattern: str, name: str) -> bool:
    """`pattern` names the module `name` whole (fnmatch) or its trailing part: 'wq' and
    'attention.wq' name 'layers.0.attention.wq'; 'layers.0.*' names every module of block 0."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def in_block(name: str) -> bool:
    """Whether the module `name` lies inside a transformer block and is no router (all-linear)."""
    return bool(_IN_BLOCK.match(name)) and ".router." not in f".{name}."


def block_part(name: str) -> str:
    """A module's name within its block ('layers.3.attention.wq' -> 'attention.wq'); others as they are."""
    return _IN_BLOCK.sub("", name)


def expert_weights(model: nn.Module) -> list[str]:
    """The names of routed experts' weights: parameters of 3 dims (experts x out x in), held by a
    module that is no linear layer."""
    return [f"{name}.{p_name}" for name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p_name, p in m.named_parameters(recurse=False) if p.dim() == 3]


def select_targets(model: nn.Module, patterns: list[str]) -> dict[str, nn.Linear]:
    """The linear layers of `model` that `patterns` (lora.target_modules) name, by name."""
    layers = linear_layers(model)
    return {name: m for name, m in layers.items()
            if any(in_block(name) if p == ALL_LINEAR else matches(p, name) for p in patterns)}
