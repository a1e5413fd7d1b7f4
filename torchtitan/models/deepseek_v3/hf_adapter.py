"""DeepSeek-V3's HFAdapter (torchtitan/models/hf_adapter.py): hf_format's functions, for the
TrainSpec registration (`hf_adapter=DeepSeekV3HFAdapter()`). Its HF names depend on the args (the
MTP modules are numbered after the last block), so `from_hf_names` takes them
(`from_hf_names_takes_args`)."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Iterable

from torchtitan.errors import CheckpointError
from torchtitan.models.deepseek_v3 import hf_format
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs

if TYPE_CHECKING:
    import torch

_INDEX = re.compile(r"^(layers|mtp)\.(\d+)\.")


def _count(fqns: Iterable[str], kind: str) -> int:
    """How many blocks (`layers`) or MTP modules (`mtp`) `fqns` reach: the highest index, plus one."""
    found = [int(m.group(2)) for m in map(_INDEX.match, fqns) if m and m.group(1) == kind]
    return max(found) + 1 if found else 0


class DeepSeekV3HFAdapter:
    """Hugging Face `DeepseekV3ForCausalLM` names, layouts and config.json."""

    family = "DeepSeek-V3"
    from_hf_names_takes_args = True

    def hf_architecture(self, args: DeepSeekV3ModelArgs) -> str:
        return hf_format.ARCHITECTURE

    def to_hf_name(self, fqn: str) -> str | None:
        return hf_format.to_hf_name(fqn)

    def from_hf_names(self, name: str, args: DeepSeekV3ModelArgs | None = None) -> tuple[str, ...]:
        return hf_format.from_hf_names(name, args)

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        """The names of the model `fqns` sketch: as many blocks and MTP modules as they reach, a
        compressed query if they have one, MoE blocks from the first they hold on, shared experts
        if any."""
        fqns = list(fqns)
        n_layers, depth = _count(fqns, "layers"), _count(fqns, "mtp")

        def layer_id(fqn: str) -> int:
            m = _INDEX.match(fqn)
            return int(m.group(2)) + (n_layers if m.group(1) == "mtp" else 0)

        moe = [layer_id(f) for f in fqns if ".moe." in f]
        args = DeepSeekV3ModelArgs(n_layers=n_layers, mtp_depth=depth, num_experts=1 if moe else 0,
                                   n_dense_layers=min(moe) if moe else n_layers + depth,
                                   q_lora_rank=1 if any(".attention.wq_a." in f for f in fqns) else 0,
                                   n_shared_experts=1 if any(".shared_experts." in f for f in fqns) else 0)
        return hf_format.param_names(args)

    def promised_but_missing(self, args: DeepSeekV3ModelArgs, fqns: Iterable[str]) -> str | None:
        """A folder whose config.json promises MTP modules its weights lack altogether: transformers'
        DeepseekV3ForCausalLM has no MTP module, and its save_pretrained keeps num_nextn_predict_layers
        (1 by default) while writing none."""
        if args.mtp_depth and not any(f.startswith("mtp.") for f in fqns):
            layers = f"layer{'s' if args.mtp_depth > 1 else ''} model.layers.{args.n_layers}"
            layers += f"-{args.n_layers + args.mtp_depth - 1}" if args.mtp_depth > 1 else ""
            return (f"config.json promises {args.mtp_depth} multi-token prediction {layers} (num_nextn_predict_layers "
                    f"{args.mtp_depth}), but the weights hold none (transformers' save_pretrained writes "
                    "num_nextn_predict_layers 1 without them); set num_nextn_predict_layers to 0 in config.json")
        return None

    def to_hf_tensors(self, fqn: str, w: torch.Tensor, args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
        return hf_format.to_hf_tensors(fqn, w, args)

    def from_hf_tensors(self, fqn: str, parts: dict[str, torch.Tensor], args: DeepSeekV3ModelArgs) -> torch.Tensor:
        return hf_format.from_hf_tensors(fqn, parts, args)

    def tensors_without_hf(self, args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
        return {}  # the expert bias is HF's e_score_correction_bias

    def ties_embeddings(self, args: DeepSeekV3ModelArgs) -> bool:
        return False

    def hf_config(self, args: DeepSeekV3ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        return hf_format.hf_config(args, torch_dtype, **extra)

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> DeepSeekV3ModelArgs:
        return hf_format.model_args_from_hf_config(cfg)

    def args_with_shapes(self, base: DeepSeekV3ModelArgs | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> DeepSeekV3ModelArgs:
        """Every size the shapes tell. The head count and head sizes follow from three shapes (o_proj's
        columns are heads x v_head_dim, kv_b_proj's rows heads x (nope + v), the query's rows heads x
        (nope + rope)); what shapes cannot tell (routing, eps, RoPE) comes from `base`."""
        claimed = "the flavor they claim" if base is not None else "the family's default flavor"
        base = DeepSeekV3ModelArgs() if base is None else base
        rows, dim = shapes["tok_embeddings.weight"]
        n_layers, depth = _count(shapes, "layers"), _count(shapes, "mtp")
        a = "layers.0.attention."
        q_lora = shapes[a + "wq_a.weight"][0] if a + "wq_a.weight" in shapes else 0
        q_rows = shapes[a + ("wq_b.weight" if q_lora else "wq.weight")][0]
        (kv_lora,) = shapes[a + "kv_norm.weight"]
        rope = shapes[a + "wkv_a.weight"][0] - kv_lora
        heads_v, heads_kv = shapes[a + "wo.weight"][1], shapes[a + "wkv_b.weight"][0]
        heads, leftover = divmod(q_rows - (heads_kv - heads_v), rope) if rope > 0 else (0, 1)
        if heads <= 0 or leftover or heads_v % heads or (heads_kv - heads_v) % heads:
            raise CheckpointError(f"the attention shapes of layer 0 (query rows {q_rows}, kv_b_proj rows {heads_kv}, "
                                  f"o_proj columns {heads_v}) fit no head layout")
        for flag, given in (("--n-heads", n_heads), ("--n-kv-heads", n_kv_heads)):
            if given is not None and given != heads:
                raise CheckpointError(f"{flag} {given} does not fit layer 0's {heads} attention heads")
        moe_layers = sorted(int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.endswith("moe.experts.w1"))
        args = dataclasses.replace(base, dim=dim, vocab_size=rows, vocab_padding=0, n_layers=n_layers, mtp_depth=depth,
                                   n_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_rope_head_dim=rope,
                                   v_head_dim=heads_v // heads, qk_nope_head_dim=(heads_kv - heads_v) // heads,
                                   n_dense_layers=moe_layers[0] if moe_layers else n_layers + depth)
        dense = "layers.0.feed_forward.w1.weight"
        if dense in shapes:
            args = dataclasses.replace(args, hidden_dim=shapes[dense][0])
        if not moe_layers:
            return args
        n_experts, moe_hidden, _ = shapes[f"layers.{moe_layers[0]}.moe.experts.w1"]
        shared = shapes.get(f"layers.{moe_layers[0]}.shared_experts.w1.weight")
        if not base.is_moe or base.top_k > n_experts or n_experts % base.n_group:
            raise CheckpointError(f"the weights hold {n_experts} experts per block, which the routing of {claimed} "
                                  f"({base.num_experts} experts, {base.top_k} per token, {base.n_group} groups) does "
                                  "not fit; record the flavor that trained them (torch-to-dcp --flavor)")
        return dataclasses.replace(args, num_experts=n_experts, moe_hidden_dim=moe_hidden,
                                   n_shared_experts=shared[0] // moe_hidden if shared else 0)
