"""Hugging Face's MoE expert tensors in our stacked layout, for every family whose HF checkpoints
store experts as Qwen3-MoE's and DeepSeek-V3's do (`model.layers.N.mlp.experts.E.<proj>.weight`, or
transformers 5's fused `gate_up_proj` / `down_proj`)."""

from __future__ import annotations

import re

import torch

from torchtitan.errors import CheckpointError

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)\.weight$")


def stacked_experts_from_hf(fqn: str, suffix: str, parts: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """Our stacked experts `fqn` (experts, out, in; `suffix` its `moe.experts.w1|w2|w3` part) from
    `parts`, the HF tensors that hold it: one per expert, or transformers' fused one; `n` experts
    as config.json says. One line for a mix of layouts, a missing, extra or misshapen expert."""
    per_expert: dict[int, tuple[str, torch.Tensor]] = {}
    fused: list[tuple[str, torch.Tensor]] = []
    for name, tensor in parts.items():
        expert = _EXPERT.match(_BLOCK.match(name).group(2))
        if expert:
            per_expert[int(expert.group(1))] = (name, tensor)
        else:
            fused.append((name, tensor))
    if fused and per_expert:
        raise CheckpointError(f"{fused[0][0]} and {next(iter(per_expert.values()))[0]} both hold {fqn}; keep one "
                              "layout of the experts")
    if fused:
        name, tensor = fused[0]
        if tensor.dim() != 3 or tensor.shape[0] != n:
            raise CheckpointError(f"{name} has shape {list(tensor.shape)}, not one matrix for each of config.json's "
                                  f"{n} experts")
        if suffix == "moe.experts.w2":
            return tensor
        half = tensor.shape[1] // 2  # gate rows, then up rows (transformers chunks them in this order)
        return tensor[:, :half] if suffix == "moe.experts.w1" else tensor[:, half:]
    some_name = next(iter(per_expert.values()))[0]
    beyond = sorted(j for j in per_expert if j >= n)
    if beyond:
        raise CheckpointError(f"{per_expert[beyond[0]][0]} is beyond config.json's {n} experts")
    missing = [j for j in range(n) if j not in per_expert]
    if missing:
        name = re.sub(r"experts\.\d+\.", f"experts.{missing[0]}.", some_name)
        raise CheckpointError(f"{name} is missing (config.json has {n} experts)")
    first = per_expert[0][1].shape
    for j in range(n):
        name, tensor = per_expert[j]
        if tensor.shape != first:
            raise CheckpointError(f"{name} has shape {list(tensor.shape)}, expert 0's {list(first)}")
    return torch.stack([per_expert[j][1] for j in range(n)])
