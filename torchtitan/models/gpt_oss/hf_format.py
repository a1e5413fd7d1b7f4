"""gpt-oss <-> Hugging Face `GptOssForCausalLM`: parameter names, tensor layouts and config.json (no I/O).

What differs besides the names:
- Experts. transformers keeps each block's experts fused and transposed: `mlp.experts.gate_up_proj`
  (experts, dim, 2 x hidden) with the gate in the even columns and the up projection in the odd ones
  (interleaved, not halves), `gate_up_proj_bias` likewise, `down_proj` (experts, hidden, dim) and
  `down_proj_bias`. Ours are stacked per projection, (experts, out, in): w1 is the even columns of
  gate_up_proj transposed, w3 the odd ones, w2 down_proj transposed; b1 / b3 / b2 the biases. An
  export builds gate_up_proj from w1 and w3 (`to_hf_fused`); gpt-oss has no per-expert layout.
- MXFP4. OpenAI publishes the experts' matrices quantized (`quantization_config` quant_method
  "mxfp4"): `gate_up_proj_blocks` / `gate_up_proj_scales` and `down_proj_blocks` / `down_proj_scales`,
  the stored rows being the dense tensor's columns. An import dequantizes them (hf_experts.py), only
  the rows each of ours needs, to bfloat16, in which every MXFP4 value is exact; the biases and every
  other tensor are stored unquantized. Exports are dense, and their config.json has no
  quantization_config.
- RoPE needs no permutation: our gpt-oss rotates HF's halves (model.py), so q/k weights and biases are
  used as published. The YaRN settings travel both ways, `truncate` included.
- `moe.expert_bias`, the auxiliary-loss-free balancing bias (torchtitan/models/moe.py), has no HF
  counterpart (the router's own `bias`, our `moe.router.gate.bias`, is a parameter, kept both ways):
  an export leaves it out, an import sets it to a fresh model's zeros.

config.json: RoPE from `rope_parameters` (transformers 5) or the top-level `rope_theta` /
`rope_scaling` (OpenAI's files), both written; absent fields get transformers' GptOssConfig defaults;
fields that change the computation in a way this model cannot reproduce are refused (CheckpointError,
one line naming the field).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from torchtitan.errors import CheckpointError
from torchtitan.models.gpt_oss.model import GptOssModelArgs, YarnRope
from torchtitan.models.hf_adapter import (
    agreed_rope_theta,
    agreed_scaling,
    aliased_positive_int,
    check_common_fields,
    check_yarn_dict,
    positive_int,
    positive_number,
    rope_dicts,
    yarn_fields,
)
from torchtitan.models.hf_experts import dequantize_mxfp4

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"

# Our FQN suffix within a block -> HF suffix within `model.layers.{i}`, one to one.
_ATTENTION_NAMES = {
    **{f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_MOE_NAMES = {
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w2": "mlp.experts.down_proj",
    "moe.experts.b2": "mlp.experts.down_proj_bias",
}
_BLOCK_NAMES = {**_ATTENTION_NAMES, **_MOE_NAMES}
# The interleaved gate/up tensors: ours -> (the fused HF tensor, the parity of its columns).
_GATE_UP = {"moe.experts.w1": ("mlp.experts.gate_up_proj", 0), "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
            "moe.experts.b1": ("mlp.experts.gate_up_proj_bias", 0), "moe.experts.b3": ("mlp.experts.gate_up_proj_bias", 1)}
# HF tensors holding several of ours, or MXFP4 parts of one: HF suffix -> our suffixes.
_SHARED_NAMES = {
    "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.gate_up_proj_bias": ("moe.experts.b1", "moe.experts.b3"),
    "mlp.experts.gate_up_proj_blocks": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.gate_up_proj_scales": ("moe.experts.w1", "moe.experts.w3"),
    "mlp.experts.down_proj_blocks": ("moe.experts.w2",),
    "mlp.experts.down_proj_scales": ("moe.experts.w2",),
}
_NOT_IN_HF = "moe.expert_bias"
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP_NAMES.items()}
_OUR_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Config fields that change the computation, with the values this model computes with (absent or
# null: the first). transformers' gpt-oss ignores hidden_act (its experts always compute the clamped
# SwiGLU), but a config naming another activation describes another model. Dropout changes training.
_REQUIRED_HF_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "attention_dropout": (0.0,),
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "truncate", "partial_rotary_factor", "attention_factor", "mscale", "mscale_all_dim"}
# transformers' GptOssConfig defaults, for absent fields (the 120B's shapes; RoPE as both releases).
_HF_DEFAULTS = dict(num_local_experts=128, intermediate_size=2880, head_dim=64, num_key_value_heads=8,
                    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=150000.0, swiglu_limit=7.0, swiglu_alpha=1.702)
_HF_DEFAULT_YARN = YarnRope(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                            truncate=False)


# ---------------------------------------------------------------------------------------------
# Names


def to_hf_name(fqn: str) -> str | None:
    """HF's name for one of our FQNs: w1 and w3 (b1 and b3) both name the fused gate_up_proj
    (gate_up_proj_bias) they are columns of; None for `moe.expert_bias`; KeyError for a name that is
    not a gpt-oss tensor."""
    if fqn in _TOP_NAMES:
        return _TOP_NAMES[fqn]
    match = _OUR_BLOCK.match(fqn)
    if match:
        layer, suffix = match.groups()
        if suffix in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[suffix]}"
        if suffix in _GATE_UP:
            return f"model.layers.{layer}.{_GATE_UP[suffix][0]}"
        if suffix == _NOT_IN_HF:
            return None
    raise KeyError(fqn)


def from_hf_names(name: str) -> tuple[str, ...]:
    """Our FQNs that HF's tensor `name` is or holds part of (two for the fused gate/up tensors, and
    for their MXFP4 blocks and scales); KeyError for a name that is not a `GptOssForCausalLM` tensor."""
    if name in _TOP_BACK:
        return (_TOP_BACK[name],)
    match = _HF_BLOCK.match(name)
    if match:
        layer, suffix = match.groups()
        if suffix in _BLOCK_BACK:
            return (f"layers.{layer}.{_BLOCK_BACK[suffix]}",)
        if suffix in _SHARED_NAMES:
            return tuple(f"layers.{layer}.{ours}" for ours in _SHARED_NAMES[suffix])
    raise KeyError(name)


def param_names(n_layers: int, attention_bias: bool = True) -> list[str]:
    """Every FQN in the state dict of a gpt-oss with `n_layers` blocks (the expert_bias buffers included)."""
    attention = [k for k in _ATTENTION_NAMES if attention_bias or not k.endswith(".bias")]
    block = [*attention, *_MOE_NAMES, *_GATE_UP, _NOT_IN_HF]
    return ["tok_embeddings.weight", *(f"layers.{i}.{s}" for i in range(n_layers) for s in block), "norm.weight",
            "output.weight"]


# ---------------------------------------------------------------------------------------------
# Tensors


def _suffix(fqn: str) -> str:
    match = _OUR_BLOCK.match(fqn)
    return match.group(2) if match else ""


def to_hf_tensors(fqn: str, w: torch.Tensor, args: GptOssModelArgs) -> dict[str, torch.Tensor]:
    """HF's tensors that store our tensor `fqn`: itself, or w2 transposed; for w1 / w3 (b1 / b3), their
    part of the fused gate_up_proj (gate_up_proj_bias) in HF's orientation, which `to_hf_fused`
    interleaves with the other part; none for expert_bias."""
    name = to_hf_name(fqn)
    if name is None:
        return {}
    suffix = _suffix(fqn)
    if suffix in ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"):
        return {name: w.transpose(1, 2)}
    return {name: w}


def to_hf_fused(name: str, parts: dict[str, torch.Tensor], args: GptOssModelArgs) -> torch.Tensor:
    """The fused gate_up_proj (or its bias) from the parts `to_hf_tensors` gave for w1 and w3 (b1 and
    b3): the gate's columns at the even places, the up projection's at the odd ones."""
    by_parity = {_GATE_UP[_suffix(fqn)][1]: t for fqn, t in parts.items()}
    return torch.stack((by_parity[0], by_parity[1]), dim=-1).flatten(-2)


def _experts_tensor(name: str, tensor: torch.Tensor, dims: int, args: GptOssModelArgs) -> torch.Tensor:
    if tensor.dim() != dims or tensor.shape[0] != args.num_experts:
        raise CheckpointError(f"{name} has shape {list(tensor.shape)}, not one {'matrix' if dims == 3 else 'vector'} "
                              f"for each of config.json's {args.num_experts} experts")
    return tensor


def from_hf_tensors(fqn: str, parts: dict[str, torch.Tensor], args: GptOssModelArgs) -> torch.Tensor:
    """Our tensor `fqn` from the HF tensors `from_hf_names` relates to it: the inverse of
    `to_hf_tensors`, and MXFP4 experts dequantized."""
    suffix = _suffix(fqn)
    if suffix in ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"):
        dense = {n: t for n, t in parts.items() if not n.endswith(("_blocks", "_scales"))}
        quantized = sorted(n for n in parts if n.endswith(("_blocks", "_scales")))
        if dense and quantized:
            raise CheckpointError(f"{next(iter(dense))} and {quantized[0]} both hold {fqn}; keep one (dense or MXFP4)")
        if quantized:
            return _dequantized(fqn, suffix, parts)
        ((name, tensor),) = dense.items()
        tensor = _experts_tensor(name, tensor, 3, args)
        if suffix == "moe.experts.w2":
            return tensor.transpose(1, 2)
        return tensor[:, :, _GATE_UP[suffix][1]::2].transpose(1, 2)
    (w,) = parts.values()  # every other HF name holds one of ours, or part of one: the biases
    if suffix in _GATE_UP:
        name = next(iter(parts))
        return _experts_tensor(name, w, 2, args)[:, _GATE_UP[suffix][1]::2]
    return w


def _dequantized(fqn: str, suffix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our w1, w3 or w2 from MXFP4 blocks and scales: the stored rows are the dense tensor's columns,
    so w1 (w3) is the even (odd) rows as they are, and w2 all of them; nothing is transposed."""
    blocks = next((n for n in parts if n.endswith("_blocks")), None)
    scales = next((n for n in parts if n.endswith("_scales")), None)
    if blocks is None or scales is None:
        have = blocks or scales
        other = have.removesuffix("_blocks") + "_scales" if blocks else have.removesuffix("_scales") + "_blocks"
        raise CheckpointError(f"{have} has no {other} beside it (MXFP4 needs both)")
    rows = slice(None) if suffix == "moe.experts.w2" else slice(_GATE_UP[suffix][1], None, 2)
    return dequantize_mxfp4(parts[blocks], parts[scales], blocks, rows=rows)


def tensors_without_hf(args: GptOssModelArgs) -> dict[str, torch.Tensor]:
    """expert_bias of every block, as a fresh model starts it (zeros; float32, as MoE makes it)."""
    return {f"layers.{i}.{_NOT_IN_HF}": torch.zeros(args.num_experts) for i in range(args.n_layers)}


# ---------------------------------------------------------------------------------------------
# config.json


def layer_types(args: GptOssModelArgs) -> list[str]:
    """Every block's attention, as config.json lists it."""
    return [SLIDING if args.layer_window(i) is not None else FULL for i in range(args.n_layers)]


def hf_config(args: GptOssModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    """The config.json of a `GptOssForCausalLM` with the shapes and numerics of `args`, with the fields
    and spellings of OpenAI's release (plus transformers 5's `rope_parameters` and `swiglu_alpha`), and
    no quantization_config: exports are dense. The vocabulary is `vocab_size + vocab_padding`: HF has
    no notion of masked padding rows."""
    if args.norm_type not in ("rmsnorm", "fused_rmsnorm"):
        raise CheckpointError(f"norm_type {args.norm_type!r} has no GptOssForCausalLM equivalent (RMSNorm)")
    y = args.rope_scaling
    scaling = None if y is None else {"rope_type": "yarn", **dataclasses.asdict(y)}
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": args.vocab_size + args.vocab_padding,
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "sliding_window": args.sliding_window,
        "layer_types": layer_types(args),
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta} if y is None
        else {**scaling, "rope_theta": args.rope_theta},
        "tie_word_embeddings": False,
        # HF's own load-balancing loss, off unless router logits are output; ours is set by [moe].
        "output_router_logits": False,
        "router_aux_loss_coef": 0.9,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return {**config, **extra}


def model_args_from_hf_config(cfg: dict[str, Any]) -> GptOssModelArgs:
    """The args of the `GptOssForCausalLM` that `cfg`, a parsed config.json (OpenAI's, or transformers
    4's or 5's), describes. Absent fields get transformers' defaults; layer_types equal to the default
    alternation (banded even blocks) read as the args' default (), so a published model reads as its
    flavor."""
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json does not hold a JSON object")
    _check_supported(cfg)
    d = _HF_DEFAULTS
    dim, n_heads = positive_int(cfg, "hidden_size"), positive_int(cfg, "num_attention_heads")
    n_kv_heads = cfg.get("num_key_value_heads", d["num_key_value_heads"])
    n_kv_heads = positive_int({"num_key_value_heads": n_heads if n_kv_heads is None else n_kv_heads},
                              "num_key_value_heads")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
    head_dim = cfg.get("head_dim", d["head_dim"])
    head_dim = positive_int({"head_dim": dim // n_heads if head_dim is None else head_dim}, "head_dim")
    if head_dim % 2:
        raise CheckpointError(f"head_dim {head_dim} is odd; RoPE rotates pairs")
    n_layers = positive_int(cfg, "num_hidden_layers")
    n_experts = aliased_positive_int(cfg, ("num_local_experts", "num_experts"), d["num_local_experts"])
    # `experts_per_token` is OpenAI's own name, which its files carry beside transformers'.
    top_k = aliased_positive_int(cfg, ("num_experts_per_tok", "experts_per_token"), d["num_experts_per_tok"])
    if top_k > n_experts:
        raise CheckpointError(f"num_experts_per_tok {top_k} is more than the {n_experts} experts")
    max_seq_len = positive_int(cfg, "max_position_embeddings", d["max_position_embeddings"])
    theta, scaling = _rope(cfg, max_seq_len)
    kinds = _layer_types(cfg, n_layers)
    if "sliding_window" in cfg and cfg["sliding_window"] is None and SLIDING in kinds:  # absent: the default
        raise CheckpointError("sliding_window is null, but layer_types has sliding_attention layers")
    bias = cfg.get("attention_bias")
    if bias is not None and not isinstance(bias, bool):
        raise CheckpointError(f"attention_bias {bias!r} is not true or false")
    args = GptOssModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        vocab_size=positive_int(cfg, "vocab_size"), norm_eps=positive_number(cfg, "rms_norm_eps", d["rms_norm_eps"]),
        max_seq_len=max_seq_len, rope_theta=theta, rope_scaling=scaling,
        sliding_window=positive_int(cfg, "sliding_window", d["sliding_window"]), attention_bias=bias is not False,
        num_experts=n_experts, top_k=top_k, moe_hidden_dim=positive_int(cfg, "intermediate_size", d["intermediate_size"]),
        swiglu_limit=positive_number(cfg, "swiglu_limit", d["swiglu_limit"]),
        swiglu_alpha=positive_number(cfg, "swiglu_alpha", d["swiglu_alpha"]),
    )
    default = dataclasses.replace(args, layer_types=())
    return default if layer_types(default) == kinds else dataclasses.replace(args, layer_types=tuple(kinds))


def _check_supported(cfg: dict[str, Any]) -> None:
    """Refuses what this model cannot compute, each in one line naming the field."""
    check_common_fields(cfg, MODEL_TYPE, "gpt-oss", _REQUIRED_HF_VALUES)
    quant = cfg.get("quantization_config")
    if quant is not None:
        if not isinstance(quant, dict):
            raise CheckpointError(f"quantization_config {quant!r} is not a JSON object")
        method = quant.get("quant_method")
        if method != "mxfp4":
            raise CheckpointError(f"quantization_config quant_method {method!r} is not supported (only OpenAI's "
                                  "MXFP4 experts, which an import dequantizes)")


def _layer_types(cfg: dict[str, Any], n_layers: int) -> list[str]:
    """Each block's attention: config.json's layer_types, or transformers' default (banded even blocks)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise CheckpointError(f"layer_types {kinds!r} is not a list of num_hidden_layers {n_layers} entries")
    odd = next((k for k in kinds if k not in (SLIDING, FULL)), None)
    if odd is not None:
        raise CheckpointError(f"layer_types entry {odd!r} is not supported (this gpt-oss has {SLIDING} and {FULL} "
                              "layers)")
    return kinds


def _rope(cfg: dict[str, Any], max_seq_len: int) -> tuple[float, YarnRope | None]:
    """(theta, YaRN or None): every place that sets them must agree (transformers 4 and 5 read different
    ones); with neither `rope_parameters` nor `rope_scaling`, gpt-oss's own YaRN, as GptOssConfig."""
    dicts = rope_dicts(cfg)
    scalings: dict[str, YarnRope | None] = {}
    for key, raw, kind in dicts:
        # transformers' YaRN attention factor is 0.1 ln(factor) + 1 unless these change it; ours is that.
        check_yarn_dict(key, raw, kind, "gpt-oss", _ROPE_KEYS, (("partial_rotary_factor", (None, 1, 1.0)),
                                                               ("attention_factor", (None,)), ("mscale", (None, 0, 0.0)),
                                                               ("mscale_all_dim", (None, 0, 0.0))))
        truncate = raw.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise CheckpointError(f"{key} truncate {truncate!r} is not true or false")
        # transformers truncates the correction range unless told not to (`truncate` absent: true).
        scalings[key] = YarnRope(**yarn_fields(raw, key, max_seq_len), truncate=truncate is not False) \
            if kind == "yarn" else None
    theta = agreed_rope_theta(cfg, dicts, _HF_DEFAULTS["rope_theta"])
    return theta, agreed_scaling(scalings) if scalings else _HF_DEFAULT_YARN
