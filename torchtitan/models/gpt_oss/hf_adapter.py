"""gpt-oss's HFAdapter (torchtitan/models/hf_adapter.py): hf_format's functions, for the TrainSpec
registration (`hf_adapter=GptOssHFAdapter()`). Its fused gate/up tensor is made of two of ours, so
it has `to_hf_fused`, which the writers call once both parts are there."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable

from torchtitan.errors import CheckpointError
from torchtitan.models.gpt_oss import hf_format
from torchtitan.models.gpt_oss.model import GptOssModelArgs
from torchtitan.models.hf_adapter import blocks_reached

if TYPE_CHECKING:
    import torch


class GptOssHFAdapter:
    """Hugging Face `GptOssForCausalLM` names, layouts and config.json; MXFP4 experts read dequantized."""

    family = "gpt-oss"

    def hf_architecture(self, args: GptOssModelArgs) -> str:
        return hf_format.ARCHITECTURE

    def to_hf_name(self, fqn: str) -> str | None:
        return hf_format.to_hf_name(fqn)

    def from_hf_names(self, name: str) -> tuple[str, ...]:
        return hf_format.from_hf_names(name)

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        """The names of a gpt-oss with as many blocks as `fqns` reach, with attention biases if they have any."""
        fqns = list(fqns)
        return hf_format.param_names(blocks_reached(fqns), any(f.endswith(".attention.wq.bias") for f in fqns))

    def to_hf_tensors(self, fqn: str, w: torch.Tensor, args: GptOssModelArgs) -> dict[str, torch.Tensor]:
        return hf_format.to_hf_tensors(fqn, w, args)

    def to_hf_fused(self, name: str, parts: dict[str, torch.Tensor], args: GptOssModelArgs) -> torch.Tensor:
        return hf_format.to_hf_fused(name, parts, args)

    def from_hf_tensors(self, fqn: str, parts: dict[str, torch.Tensor], args: GptOssModelArgs) -> torch.Tensor:
        return hf_format.from_hf_tensors(fqn, parts, args)

    def tensors_without_hf(self, args: GptOssModelArgs) -> dict[str, torch.Tensor]:
        return hf_format.tensors_without_hf(args)

    def ties_embeddings(self, args: GptOssModelArgs) -> bool:
        return False

    def hf_config(self, args: GptOssModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        return hf_format.hf_config(args, torch_dtype, **extra)

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> GptOssModelArgs:
        return hf_format.model_args_from_hf_config(cfg)

    def args_with_shapes(self, base: GptOssModelArgs | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> GptOssModelArgs:
        """Every size from the shapes, head counts included: the sinks are one per query head, so the
        query rows give head_dim and the key rows the key/value heads, which --n-heads / --n-kv-heads
        may only confirm. What shapes cannot tell (experts per token, the window and which blocks are
        banded, RoPE, the SwiGLU clamp, eps) comes from `base`."""
        claimed = "the flavor they claim" if base is not None else "the family's default flavor"
        base = GptOssModelArgs() if base is None else base
        rows, dim = shapes["tok_embeddings.weight"]
        (heads,) = shapes["layers.0.attention.sinks"]
        head_dim = shapes["layers.0.attention.wq.weight"][0] // heads
        counts = {"--n-heads": heads, "--n-kv-heads": shapes["layers.0.attention.wk.weight"][0] // head_dim}
        for flag, given in (("--n-heads", n_heads), ("--n-kv-heads", n_kv_heads)):
            if given is not None and given != counts[flag]:
                raise CheckpointError(f"{flag} {given} does not fit layer 0's {counts[flag]} heads of {head_dim} dims")
        n_experts, moe_hidden, _ = shapes["layers.0.moe.experts.w1"]
        if base.top_k > n_experts:
            raise CheckpointError(f"the weights hold {n_experts} experts per block, fewer than the {base.top_k} per token "
                                  f"of {claimed}; record the flavor that trained them (torch-to-dcp --flavor)")
        n_layers = blocks_reached(shapes)
        return dataclasses.replace(base, dim=dim, n_heads=heads, n_kv_heads=counts["--n-kv-heads"], head_dim=head_dim,
                                   vocab_size=rows, vocab_padding=0, n_layers=n_layers, num_experts=n_experts,
                                   moe_hidden_dim=moe_hidden,
                                   attention_bias="layers.0.attention.wq.bias" in shapes,
                                   layer_types=base.layer_types if len(base.layer_types) == n_layers else ())
