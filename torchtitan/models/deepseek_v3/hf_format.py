"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: parameter names, tensor layouts and
config.json (no I/O).

What differs besides the names:
- MTP. DeepSeek's files hold multi-token prediction module k as one more decoder layer,
  `model.layers.{num_hidden_layers + k}`, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
  (our `mtp.{k}.norm`) and copies of the embedding (`embed_tokens`) and output projection
  (`shared_head.head`), which our model shares: an import skips the copies, an export writes them,
  so the folder has DeepSeek's layout. Which layers are MTP depends on num_hidden_layers, so names
  are read with the args (`from_hf_names(name, args)`); transformers' own model ignores them.
- Experts. Ours are stacked (`moe.experts.w1`, (experts, out, in)); DeepSeek's files and
  transformers' `save_pretrained` store one tensor per expert (`mlp.experts.{j}.gate_proj.weight`),
  written here; transformers' fused `mlp.experts.gate_up_proj` / `down_proj` are read too.
- RoPE. DeepSeek's files rotate adjacent pairs like our `apply_rope` (`rope_interleave` true,
  transformers' default): no permutation. A folder with `rope_interleave` false pairs dim i with
  i + d/2: the RoPE rows of q_proj / q_b_proj (each head's last qk_rope_head_dim rows) and of
  kv_a_proj_with_mqa (its last qk_rope_head_dim rows) are permuted on import, and back on export
  to such a folder (its args are a `RotateHalfArgs`).
- fp8. DeepSeek publishes fp8 weights with a `weight_scale_inv` per 128 x 128 block
  (`quantization_config`): an import dequantizes them to bfloat16 (weight x scale of its block).
  Exports are unquantized.
- `moe.expert_bias` is HF's `mlp.gate.e_score_correction_bias` (added to the sigmoid scores to
  choose experts, never to weigh them), so routing is kept both ways.

config.json: RoPE from `rope_parameters` (transformers 5) or top-level `rope_theta` / `rope_scaling`
(DeepSeek's files), both written; absent fields get transformers' defaults (DeepseekV3Config);
fields that change the computation in a way this model cannot reproduce are refused
(CheckpointError, one line naming the field).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.errors import CheckpointError
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs, YarnScaling
from torchtitan.models.hf_adapter import (
    agreed_rope_theta,
    agreed_scaling,
    check_common_fields,
    check_yarn_dict,
    positive_int,
    positive_number,
    rope_dicts,
    rope_rows_from_hf,
    rope_rows_to_hf,
    yarn_fields,
)
from torchtitan.models.hf_experts import stacked_experts_from_hf

ARCHITECTURE, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"


@dataclass
class RotateHalfArgs(DeepSeekV3ModelArgs):
    """The args of an HF folder whose config.json says `rope_interleave: false`: the same model, whose
    RoPE rows an export to that folder permutes back to HF's rotate_half halves."""


# Our FQN suffix within a block -> HF suffix within `model.layers.{i}`, one to one.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERT_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_FUSED_NAMES = {"mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"), "mlp.experts.down_proj": ("moe.experts.w2",)}
# An MTP module's own tensors (beside its block's), ours -> HF within its layer.
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
              "norm.weight": "shared_head.norm.weight"}
# The copies of the shared embedding and output projection an MTP layer holds in DeepSeek's files.
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_EXPERT_BACK = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
_MTP_BACK = {hf: ours for ours, hf in _MTP_NAMES.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP_NAMES.items()}
_OUR_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_OUR_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)\.weight$")
_SCALE = "_scale_inv"  # fp8 weights' companion: `<name>.weight_scale_inv`
FP8_BLOCK = 128  # DeepSeek's quantization block (weight_block_size [128, 128])

# Config fields that change the computation, with the values this model computes with (absent or null: the first).
_REQUIRED_HF_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "attention_bias": (False,),
    "attention_dropout": (0.0,),
    "scoring_func": ("sigmoid",),  # DeepseekV3ForCausalLM's router scores with a sigmoid, whatever this says
    "topk_method": ("noaux_tc",),  # bias-corrected group-limited top-k, what transformers computes
    "moe_layer_freq": (1,),  # every block from first_k_dense_replace on is MoE
    "pretraining_tp": (1,),
}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "truncate", "attention_factor", "partial_rotary_factor"}
# transformers' DeepseekV3Config defaults, for absent fields (DeepSeek-V3's own shapes).
_HF_DEFAULTS = dict(intermediate_size=18432, moe_intermediate_size=2048, first_k_dense_replace=3, n_routed_experts=256,
                    n_shared_experts=1, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    max_position_embeddings=4096, rope_theta=10000.0, mtp=1)


# ---------------------------------------------------------------------------------------------
# Names


def _block_hf_suffix(suffix: str) -> str:
    if suffix in _BLOCK_NAMES:
        return _BLOCK_NAMES[suffix]
    if suffix in _EXPERT_NAMES:
        return f"mlp.experts.*.{_EXPERT_NAMES[suffix]}.weight"
    raise KeyError(suffix)


def to_hf_name(fqn: str) -> str:
    """HF's name for one of our FQNs (stacked experts with `*` for the expert). An MTP module's
    layer number is num_hidden_layers + k, which the name alone cannot tell: `mtp.{k}.X` is given as
    `mtp.{k}.<HF name within the layer>` (`to_hf_tensors` gives the real names); KeyError for a
    name that is not a DeepSeek-V3 tensor."""
    if fqn in _TOP_NAMES:
        return _TOP_NAMES[fqn]
    block = _OUR_BLOCK.match(fqn)
    try:
        if block:
            return f"model.layers.{block.group(1)}.{_block_hf_suffix(block.group(2))}"
        mtp = _OUR_MTP.match(fqn)
        if mtp:
            k, suffix = mtp.groups()
            if suffix in _MTP_NAMES:
                return f"mtp.{k}.{_MTP_NAMES[suffix]}"
            if suffix.startswith("block."):
                return f"mtp.{k}.{_block_hf_suffix(suffix.removeprefix('block.'))}"
    except KeyError:
        pass
    raise KeyError(fqn)


def _block_fqns(prefix: str, suffix: str) -> tuple[str, ...]:
    """Our FQNs (under `prefix`) that the HF block tensor `suffix` is or holds part of (fp8 scales
    go with their weight); KeyError for any other."""
    if suffix.endswith(_SCALE):
        suffix = suffix.removesuffix(_SCALE)
        if not suffix.endswith(".weight"):
            raise KeyError(suffix)
    if suffix in _BLOCK_BACK:
        return (prefix + _BLOCK_BACK[suffix],)
    expert = _HF_EXPERT.match(suffix)
    if expert and expert.group(2) in _EXPERT_BACK:
        return (prefix + _EXPERT_BACK[expert.group(2)],)
    if suffix in _FUSED_NAMES:
        return tuple(prefix + ours for ours in _FUSED_NAMES[suffix])
    raise KeyError(suffix)


def from_hf_names(name: str, args: DeepSeekV3ModelArgs | None = None) -> tuple[str, ...]:
    """Our FQNs that HF's tensor `name` is or holds part of: usually one; two for a fused
    `gate_up_proj`; none for an MTP layer's copies of the embedding and output projection. Layers
    from num_hidden_layers on are MTP modules, which needs `args` (without: every layer is a
    block). KeyError for a name that is no `DeepseekV3ForCausalLM` tensor."""
    if name in _TOP_BACK:
        return (_TOP_BACK[name],)
    match = _HF_BLOCK.match(name)
    if match:
        layer, suffix = int(match.group(1)), match.group(2)
        try:
            if args is None or layer < args.n_layers:
                return _block_fqns(f"layers.{layer}.", suffix)
            k = layer - args.n_layers
            if suffix in _MTP_COPIES.values() or suffix.removesuffix(_SCALE) in _MTP_COPIES.values():
                return ()
            bare = suffix.removesuffix(_SCALE)
            if bare in _MTP_BACK:
                return (f"mtp.{k}.{_MTP_BACK[bare]}",)
            return _block_fqns(f"mtp.{k}.block.", suffix)
        except KeyError:
            pass
    raise KeyError(name)


def param_names(args: DeepSeekV3ModelArgs) -> list[str]:
    """Every FQN in the state dict of a DeepSeekV3 with `args` (expert_bias buffers included)."""
    def block(prefix: str, layer_id: int) -> list[str]:
        moe = args.is_moe and layer_id >= args.n_dense_layers
        q = ["attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight"] if args.q_lora_rank \
            else ["attention.wq.weight"]
        names = [*q, "attention.wkv_a.weight", "attention.kv_norm.weight", "attention.wkv_b.weight",
                 "attention.wo.weight", "attention_norm.weight", "ffn_norm.weight"]
        if moe:
            names += ["moe.router.gate.weight", "moe.expert_bias", *_EXPERT_NAMES]
            if args.n_shared_experts:
                names += [f"shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
        else:
            names += [f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
        return [prefix + n for n in names]

    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += block(f"layers.{i}.", i)
    names += ["norm.weight", "output.weight"]
    for k in range(args.mtp_depth):
        names += [f"mtp.{k}.{n}" for n in _MTP_NAMES] + block(f"mtp.{k}.block.", args.n_layers + k)
    return names


# ---------------------------------------------------------------------------------------------
# Tensors


def _rope_rows(suffix: str, w: torch.Tensor, args: DeepSeekV3ModelArgs, permute) -> torch.Tensor:
    """`w` with the RoPE rows of a query or compressed key/value projection passed through
    `permute` (rope_rows_to_hf / rope_rows_from_hf) per head; other tensors unchanged."""
    rope = args.qk_rope_head_dim
    if suffix in ("attention.wq.weight", "attention.wq_b.weight"):
        heads = w.reshape(args.n_heads, args.qk_head_dim, -1)
        rotated = permute(heads[:, args.qk_nope_head_dim:].reshape(args.n_heads * rope, -1), args.n_heads)
        return torch.cat([heads[:, :args.qk_nope_head_dim], rotated.reshape(args.n_heads, rope, -1)], 1).reshape(w.shape)
    if suffix == "attention.wkv_a.weight":
        return torch.cat([w[:-rope], permute(w[-rope:], 1)])
    return w


def _layer_and_suffix(fqn: str, args: DeepSeekV3ModelArgs) -> tuple[int | None, str]:
    """(HF layer number, our suffix within the block or MTP module) of one of our FQNs; (None, fqn) at the top."""
    block = _OUR_BLOCK.match(fqn)
    if block:
        return int(block.group(1)), block.group(2)
    mtp = _OUR_MTP.match(fqn)
    if mtp:
        return args.n_layers + int(mtp.group(1)), mtp.group(2)
    return None, fqn


def to_hf_tensors(fqn: str, w: torch.Tensor, args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
    """HF's tensors that store our tensor `fqn`: one, in HF's layout; one view per expert for
    stacked experts; the embedding and output projection also as each MTP layer's copies."""
    layer, suffix = _layer_and_suffix(fqn, args)
    if layer is None:
        out = {to_hf_name(fqn): w}
        if fqn in _MTP_COPIES:
            out.update({f"model.layers.{args.n_layers + k}.{_MTP_COPIES[fqn]}": w for k in range(args.mtp_depth)})
        return out
    prefix = f"model.layers.{layer}."
    if fqn.startswith("mtp.") and suffix in _MTP_NAMES:
        return {prefix + _MTP_NAMES[suffix]: w}
    suffix = suffix.removeprefix("block.") if fqn.startswith("mtp.") else suffix
    name = prefix + _block_hf_suffix(suffix)
    if suffix in _EXPERT_NAMES:
        return {name.replace("*", str(j)): w[j] for j in range(w.shape[0])}
    if isinstance(args, RotateHalfArgs):
        w = _rope_rows(suffix, w, args, rope_rows_to_hf)
    return {name: w}


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """An fp8 weight times its per-block `weight_scale_inv` (one scale per FP8_BLOCK x FP8_BLOCK block,
    the last blocks of each axis possibly partial), in bfloat16 as DeepSeek's own dequantization."""
    rows, cols = w.shape
    expected = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{name}{_SCALE} has shape {list(scale_inv.shape)}, not {list(expected)} for "
                              f"{FP8_BLOCK} x {FP8_BLOCK} blocks of a {rows} x {cols} weight")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (w.float() * scale).to(torch.bfloat16)


def _dequantized(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`parts` with each fp8 weight and its `weight_scale_inv` replaced by the dequantized weight."""
    out = {}
    for name, tensor in parts.items():
        if name.endswith(_SCALE):
            weight = name.removesuffix(_SCALE)
            if weight not in parts:
                raise CheckpointError(f"{name} has no {weight} beside it")
            continue
        scale = parts.get(name + _SCALE)
        if scale is not None:
            tensor = dequantize_fp8(tensor, scale, name)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{name} is stored in {tensor.dtype} without its {name}{_SCALE}")
        out[name] = tensor
    return out


def from_hf_tensors(fqn: str, parts: dict[str, torch.Tensor], args: DeepSeekV3ModelArgs) -> torch.Tensor:
    """Our tensor `fqn` from the HF tensors `from_hf_names` relates to it: the inverse of
    `to_hf_tensors`, fp8 weights dequantized, stacked experts from transformers' fused tensors too."""
    parts = _dequantized(parts)
    layer, suffix = _layer_and_suffix(fqn, args)
    suffix = suffix.removeprefix("block.") if fqn.startswith("mtp.") else suffix
    if suffix in _EXPERT_NAMES:
        return stacked_experts_from_hf(fqn, suffix, parts, args.num_experts)
    (w,) = parts.values()  # every other HF name is one of ours
    return _rope_rows(suffix, w, args, rope_rows_from_hf) if isinstance(args, RotateHalfArgs) else w


def hf_config(args: DeepSeekV3ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    """The config.json of a `DeepseekV3ForCausalLM` with the shapes and numerics of `args`, with the
    fields and spellings of DeepSeek's release (plus transformers 5's `rope_parameters`). The
    vocabulary is `vocab_size + vocab_padding`: HF has no notion of masked padding rows."""
    if args.norm_type not in ("rmsnorm", "fused_rmsnorm"):
        raise CheckpointError(f"norm_type {args.norm_type!r} has no DeepseekV3ForCausalLM equivalent (RMSNorm)")
    if args.score_func != "sigmoid":
        raise CheckpointError(f"score_func {args.score_func!r} has no DeepseekV3ForCausalLM equivalent (its router "
                              "scores with sigmoid)")
    y = args.rope_scaling
    scaling = None if y is None else {"type": "yarn", **dataclasses.asdict(y)}
    rope_parameters = {"rope_type": "default" if y is None else "yarn", "rope_theta": args.rope_theta,
                       **({} if y is None else dataclasses.asdict(y))}
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": args.vocab_size + args.vocab_padding,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_nextn_predict_layers": args.mtp_depth,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.n_shared_experts,
        "n_routed_experts": args.num_experts,
        "routed_scaling_factor": args.route_scale,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "num_experts_per_tok": args.top_k,
        "moe_layer_freq": 1,
        "first_k_dense_replace": args.n_dense_layers if args.is_moe else args.n_layers,
        "norm_topk_prob": args.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "rope_interleave": not isinstance(args, RotateHalfArgs),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return {**config, **extra}


def _int(cfg: dict[str, Any], key: str, default: int, zero: bool = False) -> int:
    """cfg[key] as a positive int (or >= 0 when `zero`), `default` when absent or null."""
    value = cfg.get(key)
    value = default if value is None else value
    if zero and value == 0 and not isinstance(value, bool):
        return 0
    return positive_int({key: value}, key)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise CheckpointError(f"{key} {value!r} is not true or false")
    return value


def model_args_from_hf_config(cfg: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """The args of the `DeepseekV3ForCausalLM` that `cfg`, a parsed config.json (DeepSeek's, or
    transformers 4's or 5's), describes; a `RotateHalfArgs` when its RoPE rows are in rotate_half
    order (`rope_interleave` false)."""
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json does not hold a JSON object")
    _check_supported(cfg)
    d = _HF_DEFAULTS
    dim, n_heads = positive_int(cfg, "hidden_size"), positive_int(cfg, "num_attention_heads")
    mtp_key = next((k for k in ("num_nextn_predict_layers", "num_mtp_layers") if cfg.get(k) is not None),
                   "num_nextn_predict_layers")
    max_seq_len = _int(cfg, "max_position_embeddings", d["max_position_embeddings"])
    theta, scaling = _rope(cfg, max_seq_len)
    n_experts, top_k = _int(cfg, "n_routed_experts", d["n_routed_experts"]), _int(cfg, "num_experts_per_tok",
                                                                                    d["num_experts_per_tok"])
    n_group, topk_group = _int(cfg, "n_group", d["n_group"]), _int(cfg, "topk_group", d["topk_group"])
    if n_experts % n_group or topk_group > n_group:
        raise CheckpointError(f"n_group {n_group} must divide n_routed_experts {n_experts} and be at least "
                              f"topk_group {topk_group}")
    if top_k > topk_group * (n_experts // n_group):
        raise CheckpointError(f"num_experts_per_tok {top_k} is more than the {topk_group * (n_experts // n_group)} "
                              f"experts of topk_group {topk_group} groups")
    fields = dict(
        dim=dim, n_layers=positive_int(cfg, "num_hidden_layers"), n_heads=n_heads,
        n_dense_layers=_int(cfg, "first_k_dense_replace", d["first_k_dense_replace"], zero=True),
        hidden_dim=_int(cfg, "intermediate_size", d["intermediate_size"]), vocab_size=positive_int(cfg, "vocab_size"),
        norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6), max_seq_len=max_seq_len,
        q_lora_rank=0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else _int(cfg, "q_lora_rank", d["q_lora_rank"]),
        kv_lora_rank=_int(cfg, "kv_lora_rank", d["kv_lora_rank"]),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", d["qk_nope_head_dim"]),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", d["qk_rope_head_dim"]),
        v_head_dim=_int(cfg, "v_head_dim", d["v_head_dim"]), rope_theta=theta, rope_scaling=scaling,
        num_experts=n_experts, n_shared_experts=_int(cfg, "n_shared_experts", d["n_shared_experts"], zero=True),
        top_k=top_k, moe_hidden_dim=_int(cfg, "moe_intermediate_size", d["moe_intermediate_size"]),
        score_func="sigmoid", n_group=n_group, topk_group=topk_group,
        route_scale=positive_number(cfg, "routed_scaling_factor", d["routed_scaling_factor"]),
        norm_topk_prob=_bool(cfg, "norm_topk_prob", True), mtp_depth=_int(cfg, mtp_key, d["mtp"], zero=True),
    )
    if fields["qk_rope_head_dim"] % 2:
        raise CheckpointError(f"qk_rope_head_dim {fields['qk_rope_head_dim']} is odd; RoPE rotates pairs")
    return (DeepSeekV3ModelArgs if _bool(cfg, "rope_interleave", True) else RotateHalfArgs)(**fields)


def _check_supported(cfg: dict[str, Any]) -> None:
    """Refuses what this model cannot compute, each in one line naming the field."""
    check_common_fields(cfg, MODEL_TYPE, "DeepSeek-V3", _REQUIRED_HF_VALUES)
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != cfg["num_attention_heads"]:
        raise CheckpointError(f"num_key_value_heads {kv_heads!r} is not num_attention_heads {cfg['num_attention_heads']!r} "
                              "(multi-head latent attention has a key and value per head)")
    quant = cfg.get("quantization_config")
    if quant is not None:
        if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise CheckpointError(f"quantization_config quant_method {method!r} is not supported (only DeepSeek's "
                                  "block-scaled fp8, which an import dequantizes)")
        block = quant.get("weight_block_size")
        if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise CheckpointError(f"quantization_config weight_block_size {block!r} is not supported (DeepSeek's "
                                  f"[{FP8_BLOCK}, {FP8_BLOCK}])")


def _rope(cfg: dict[str, Any], max_seq_len: int) -> tuple[float, YarnScaling | None]:
    """(theta, YaRN scaling or None) from `rope_parameters` and/or the top-level `rope_theta` /
    `rope_scaling`; every place that sets one must agree (transformers 4 and 5 read different ones)."""
    dicts = rope_dicts(cfg)
    scalings: dict[str, YarnScaling | None] = {}
    for key, raw, kind in dicts:
        check_yarn_dict(key, raw, kind, "DeepSeek-V3", _YARN_KEYS, (("partial_rotary_factor", (None, 1, 1.0)),
                                                                    ("truncate", (None, True)), ("attention_factor", (None,))))
        scalings[key] = _yarn(raw, key, max_seq_len) if kind == "yarn" else None
    return agreed_rope_theta(cfg, dicts, _HF_DEFAULTS["rope_theta"]), agreed_scaling(scalings)


def _yarn(raw: dict[str, Any], key: str, max_seq_len: int) -> YarnScaling:
    """YaRN's settings as transformers reads them (hf_adapter.yarn_fields), mscale / mscale_all_dim 0
    (unused) when absent."""
    return YarnScaling(**yarn_fields(raw, key, max_seq_len, extra=("mscale", "mscale_all_dim")))
