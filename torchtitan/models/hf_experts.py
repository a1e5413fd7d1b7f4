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


# ---------------------------------------------------------------------------------------------
# MXFP4 (OCP Microscaling FP4): how gpt-oss publishes its experts' matrices


# The value of each FP4 E2M1 code (sign bit, two exponent bits, one mantissa bit), codes 0 to 15.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale: 16 bytes of two codes each
_CHUNK_VALUES = 1 << 21  # values dequantized at a time: bounds the temporaries (8 MiB each in float32)


def _e8m0_powers(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) for E8M0 scale bytes, in float32, exactly: the byte is a float32's exponent field
    (s = 0 is 2^-127, a float32 subnormal; 255 is infinity, as transformers' ldexp makes it), so no
    exp2 approximation can round."""
    s = scales.to(torch.int32)
    return torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23).view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str, dtype: torch.dtype = torch.bfloat16,
                     rows: slice = slice(None)) -> torch.Tensor:
    """MXFP4 matrices to `dtype`: `blocks` (experts, rows, groups, 16) uint8, two FP4 codes a byte, the
    low nibble first; `scales` (experts, rows, groups) uint8 E8M0, one per group of 32 values. Returns
    (experts, rows, groups x 32): row r of expert e is the r-th row of the matrix as stored, which for
    transformers' dense gpt-oss tensors is column r (it transposes them). Only the `rows` asked for are
    dequantized (gate_up_proj's gate rows are the even ones), a bounded chunk at a time into the result,
    so memory holds the result and a few chunk-sized temporaries. Every MXFP4 value (a 2-bit mantissa
    times a power of two) is exact in bfloat16 and float32. `name` is the blocks' HF name, for refusals."""
    base = name.removesuffix("_blocks")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{name} and {base}_scales are {str(blocks.dtype).removeprefix('torch.')} and "
                              f"{str(scales.dtype).removeprefix('torch.')}, not uint8 (MXFP4 codes and E8M0 scales)")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(f"{name} {list(blocks.shape)} and {base}_scales {list(scales.shape)} are no MXFP4 pair "
                              f"(blocks: experts, rows, groups, {MXFP4_BLOCK // 2} bytes; scales: one per group)")
    blocks, scales = blocks[:, rows], scales[:, rows]
    experts, n_rows, groups, _ = blocks.shape
    out = torch.empty((experts, n_rows, groups * MXFP4_BLOCK), dtype=dtype, device=blocks.device)
    if blocks.is_meta:  # shapes alone (a folder checked before it is read)
        return out
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    step = max(1, _CHUNK_VALUES // (groups * MXFP4_BLOCK))
    for e in range(experts):
        for r0 in range(0, n_rows, step):
            codes = blocks[e, r0:r0 + step].to(torch.int64)  # (n, groups, 16)
            values = torch.stack((lut[codes & 15], lut[codes >> 4]), dim=-1).flatten(-2)  # (n, groups, 32)
            values *= _e8m0_powers(scales[e, r0:r0 + step]).unsqueeze(-1)
            out[e, r0:r0 + step] = values.flatten(-2)
    return out
