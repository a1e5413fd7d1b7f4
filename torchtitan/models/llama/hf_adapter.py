"""Llama's HFAdapter (torchtitan/models/hf_adapter.py): hf_format's functions, registered in Llama's TrainSpecs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable

from torchtitan.errors import CheckpointError
from torchtitan.models.hf_adapter import blocks_reached
from torchtitan.models.llama import hf_format
from torchtitan.models.llama.model import ModelArgs

if TYPE_CHECKING:
    import torch


class LlamaHFAdapter:
    """Hugging Face `LlamaForCausalLM` names, q/k layouts and config.json, for Llama 2 and 3."""

    family = "Llama"

    def hf_architecture(self, args: ModelArgs) -> str:
        return "LlamaForCausalLM"

    def to_hf_name(self, fqn: str) -> str:
        return hf_format.to_hf_name(fqn)

    def from_hf_names(self, name: str) -> tuple[str, ...]:
        return (hf_format.from_hf_name(name),)  # one to one

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        return hf_format.param_names(blocks_reached(fqns))

    def to_hf_tensors(self, fqn: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
        return {hf_format.to_hf_name(fqn): hf_format.to_hf_tensor(fqn, w, args)}

    def from_hf_tensors(self, fqn: str, parts: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
        (w,) = parts.values()  # from_hf_names is one to one, so each of ours has exactly one part
        return hf_format.from_hf_tensor(fqn, w, args)

    def tensors_without_hf(self, args: ModelArgs) -> dict[str, torch.Tensor]:
        return {}

    def ties_embeddings(self, args: ModelArgs) -> bool:
        return args.tie_word_embeddings

    def hf_config(self, args: ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        return hf_format.hf_config(args, torch_dtype, **extra)

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> ModelArgs:
        return hf_format.model_args_from_hf_config(cfg)

    def args_with_shapes(self, base: ModelArgs | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> ModelArgs:
        """dim, vocabulary, layers and feed-forward size from the shapes; given the head count (which
        shapes cannot tell), the key/value head count from the key projection's rows."""
        base = ModelArgs() if base is None else base
        rows, dim = shapes["tok_embeddings.weight"]
        if n_heads is None and dim != base.dim:
            raise CheckpointError(f"the weights have dim {dim}, not the {base.dim} of the flavor they claim, so their "
                                  "head count is unknown; pass --n-heads (and --n-kv-heads)")
        n_heads = n_heads or base.n_heads
        if dim % n_heads:
            raise CheckpointError(f"dim {dim} is not divisible by {n_heads} heads; pass --n-heads")
        kv_from_shape = shapes["layers.0.attention.wk.weight"][0] // (dim // n_heads)
        if n_kv_heads is not None and n_kv_heads != kv_from_shape:
            raise CheckpointError(f"--n-kv-heads {n_kv_heads} does not fit the key projection's {kv_from_shape} heads "
                                  f"of {dim // n_heads} dims")
        # Every embedding row becomes part of HF's vocabulary: HF has no masked padding rows.
        args = dataclasses.replace(base, dim=dim, n_heads=n_heads, vocab_size=rows, vocab_padding=0,
                                   n_kv_heads=None if kv_from_shape == n_heads else kv_from_shape,
                                   n_layers=blocks_reached(shapes))
        return hf_format.with_ffn_hidden_dim(args, shapes["layers.0.feed_forward.w1.weight"][0])
