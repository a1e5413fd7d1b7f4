"""Qwen3's HFAdapter (torchtitan/models/hf_adapter.py): hf_format's functions, for the lead's TrainSpec
registration (`hf_adapter=Qwen3HFAdapter()`). One adapter serves both variants: which HF model,
`Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`, follows from the args (`is_moe`) or, for names alone,
from whether they hold MoE blocks."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable

from torchtitan.errors import CheckpointError
from torchtitan.models.hf_adapter import blocks_reached
from torchtitan.models.qwen3 import hf_format
from torchtitan.models.qwen3.model import Qwen3ModelArgs

if TYPE_CHECKING:
    import torch


class Qwen3HFAdapter:
    """Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` names, layouts and config.json."""

    family = "Qwen3"

    def hf_architecture(self, args: Qwen3ModelArgs) -> str:
        return hf_format.hf_architecture(args)

    def to_hf_name(self, fqn: str) -> str | None:
        return hf_format.to_hf_name(fqn)

    def from_hf_names(self, name: str) -> tuple[str, ...]:
        return hf_format.from_hf_names(name)

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        fqns = list(fqns)
        return hf_format.param_names(blocks_reached(fqns), hf_format.is_moe_names(fqns))

    def to_hf_tensors(self, fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
        return hf_format.to_hf_tensors(fqn, w, args)

    def from_hf_tensors(self, fqn: str, parts: dict[str, torch.Tensor], args: Qwen3ModelArgs) -> torch.Tensor:
        return hf_format.from_hf_tensors(fqn, parts, args)

    def tensors_without_hf(self, args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
        return hf_format.tensors_without_hf(args)

    def ties_embeddings(self, args: Qwen3ModelArgs) -> bool:
        return args.tie_word_embeddings

    def hf_config(self, args: Qwen3ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        return hf_format.hf_config(args, torch_dtype, **extra)

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen3ModelArgs:
        return hf_format.model_args_from_hf_config(cfg)

    def args_with_shapes(self, base: Qwen3ModelArgs | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> Qwen3ModelArgs:
        """Every size from the shapes, head counts included: head_dim is the q norm's length (Qwen3's
        head_dim is its own setting), so the q and k projections' rows give the head counts, which
        --n-heads / --n-kv-heads may only confirm. What shapes cannot tell (eps, theta, tying, how
        many experts a token chooses) comes from `base`."""
        claimed = "the flavor they claim" if base is not None else "the family's default flavor"
        base = Qwen3ModelArgs() if base is None else base
        rows, dim = shapes["tok_embeddings.weight"]
        (head_dim,) = shapes["layers.0.attention.q_norm.weight"]
        counts = {}
        for flag, given, fqn in (("--n-heads", n_heads, "layers.0.attention.wq.weight"),
                                 ("--n-kv-heads", n_kv_heads, "layers.0.attention.wk.weight")):
            counts[flag] = shapes[fqn][0] // head_dim
            if given is not None and given != counts[flag]:
                raise CheckpointError(f"{flag} {given} does not fit {fqn}'s {counts[flag]} heads of {head_dim} dims")
        args = dataclasses.replace(base, dim=dim, head_dim=head_dim, n_heads=counts["--n-heads"],
                                   n_kv_heads=counts["--n-kv-heads"], vocab_size=rows, vocab_padding=0,
                                   n_layers=blocks_reached(shapes))
        experts = shapes.get("layers.0.moe.experts.w1")
        if experts is None:
            return dataclasses.replace(args, hidden_dim=shapes["layers.0.feed_forward.w1.weight"][0], num_experts=0,
                                       top_k=0, moe_hidden_dim=0)
        n_experts, moe_hidden, _ = experts
        if not base.is_moe:
            raise CheckpointError(f"the weights hold {n_experts} experts per block, but {claimed} has none, so how many "
                                  "experts a token chooses is unknown; record the MoE flavor that trained them "
                                  "(torch-to-dcp --flavor)")
        if base.top_k > n_experts:
            raise CheckpointError(f"the weights hold {n_experts} experts per block, fewer than the {base.top_k} per token "
                                  f"of {claimed}; record the MoE flavor that trained them (torch-to-dcp --flavor)")
        return dataclasses.replace(args, num_experts=n_experts, moe_hidden_dim=moe_hidden)
