"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` and Qwen3-MoE <-> `Qwen3MoeForCausalLM`: parameter
names, tensor layouts and config.json (no I/O).

Besides the names, three things differ between this project's Qwen3 and Hugging Face's:
- RoPE pairs. Here each head's dims (2i, 2i+1) rotate together (Meta's interleaved layout); HF's
  `rotate_half` pairs dims i and i + head_dim/2. The rows of wq and wk are therefore permuted, per
  head, when converting. The per-head q/k RMSNorms run before RoPE, on the same features, so their
  weights (one per head_dim feature) get the same within-head permutation.
- Experts. Ours are stacked, one tensor per projection and layer (`moe.experts.w1`, shape
  (experts, hidden, dim)); the published checkpoints store one tensor per expert and projection
  (`mlp.experts.{j}.gate_proj.weight`, (hidden, dim)), and so does transformers 5's
  `save_pretrained` (its default `save_original_format`). transformers 5 itself computes with fused
  tensors (`mlp.experts.gate_up_proj`, gate rows then up rows, and `mlp.experts.down_proj`) and
  writes those with `save_original_format=False`: both layouts are read, the published one written.
- `moe.expert_bias`, the auxiliary-loss-free balancing bias (torchtitan/models/moe.py), has no HF
  counterpart (HF's router has no bias): an export leaves it out, an import sets it to the zeros a
  fresh model starts with. It only steers routing while `moe_bias_update_rate` > 0, so a model
  exported after bias-balanced training routes, in transformers, without its learnt bias.

config.json: RoPE settings are read from `rope_parameters` (transformers 5) or the top-level
`rope_theta` / `rope_scaling` (transformers 4), and both are written. Absent fields get
transformers' defaults for the model type; fields that change the computation in a way this
model cannot reproduce are refused (CheckpointError, one line naming the field).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.errors import CheckpointError
from torchtitan.models.hf_adapter import (
    agreed_rope_theta,
    aliased_positive_int,
    positive_int,
    positive_number,
    rope_dicts,
    rope_rows_from_hf,
    rope_rows_to_hf,
)
from torchtitan.models.hf_experts import stacked_experts_from_hf
from torchtitan.models.qwen3.model import Qwen3ModelArgs

# Our FQN suffix within a block -> HF suffix within `model.layers.{i}`, one to one.
_ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_ROUTER_NAMES = {"moe.router.gate.weight": "mlp.gate.weight"}
_BLOCK_NAMES = {**_ATTENTION_NAMES, **_DENSE_NAMES, **_ROUTER_NAMES}
# Stacked experts -> the projection of HF's per-expert tensors `mlp.experts.{j}.<projection>.weight`.
_EXPERT_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
# transformers 5's fused experts -> the stacked tensors of ours they hold (gate_up_proj: w1's rows, then w3's).
_FUSED_NAMES = {"mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"), "mlp.experts.down_proj": ("moe.experts.w2",)}
_NOT_IN_HF = "moe.expert_bias"
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES_BACK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_EXPERT_NAMES_BACK = {hf: ours for ours, hf in _EXPERT_NAMES.items()}
_TOP_NAMES_BACK = {hf: ours for ours, hf in _TOP_NAMES.items()}
_OUR_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)\.weight$")

DENSE_ARCHITECTURE, MOE_ARCHITECTURE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
_MODEL_TYPES = {"qwen3": False, "qwen3_moe": True}  # model_type -> is MoE

# Config fields that change the computation, with the values this model computes with (absent or
# null means the first). "swish" is transformers' other name for SiLU. Dropout changes training, so
# a fine-tuning run from a converted model would silently differ from one in transformers.
_REQUIRED_HF_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "attention_bias": (False,),
    "attention_dropout": (0.0,),
    "use_sliding_window": (False,),
    "partial_rotary_factor": (1.0,),
}
# Only for Qwen3-MoE: every block must be a sparse one (transformers makes the others dense MLPs).
_REQUIRED_MOE_VALUES: dict[str, tuple[Any, ...]] = {
    "decoder_sparse_step": (1,),
    "mlp_only_layers": ([],),
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}  # those of plain ("default") RoPE
_HF_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names no theta at all
# transformers' defaults for absent fields, where the two configs differ (Qwen3Config, Qwen3MoeConfig).
_HF_DEFAULT_KV_HEADS = {False: 32, True: 4}
_HF_DEFAULT_MOE = {"intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False}
_HF_DEFAULT_MAX_POSITIONS = 32768


# ---------------------------------------------------------------------------------------------
# Names


def to_hf_name(fqn: str) -> str | None:
    """HF's name for one of our FQNs: stacked experts get their per-expert names with `*` for the
    expert's index; None for `moe.expert_bias` (no HF counterpart); KeyError for a name that is
    not a Qwen3 tensor."""
    if fqn in _TOP_NAMES:
        return _TOP_NAMES[fqn]
    match = _OUR_BLOCK.match(fqn)
    if match:
        layer, suffix = match.groups()
        if suffix in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[suffix]}"
        if suffix in _EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.*.{_EXPERT_NAMES[suffix]}.weight"
        if suffix == _NOT_IN_HF:
            return None
    raise KeyError(fqn)


def from_hf_names(name: str) -> tuple[str, ...]:
    """Our FQNs that HF's tensor `name` is or holds part of (two for the fused `gate_up_proj`);
    KeyError for a name that is not a `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM` parameter."""
    if name in _TOP_NAMES_BACK:
        return (_TOP_NAMES_BACK[name],)
    match = _HF_BLOCK.match(name)
    if match:
        layer, suffix = match.groups()
        if suffix in _BLOCK_NAMES_BACK:
            return (f"layers.{layer}.{_BLOCK_NAMES_BACK[suffix]}",)
        expert = _HF_EXPERT.match(suffix)
        if expert and expert.group(2) in _EXPERT_NAMES_BACK:
            return (f"layers.{layer}.{_EXPERT_NAMES_BACK[expert.group(2)]}",)
        if suffix in _FUSED_NAMES:
            return tuple(f"layers.{layer}.{ours}" for ours in _FUSED_NAMES[suffix])
    raise KeyError(name)


def param_names(n_layers: int, moe: bool) -> list[str]:
    """Every FQN in the state dict of a Qwen3 (MoE when `moe`) with `n_layers` blocks: the tied
    output projection and the MoE's expert_bias buffer included."""
    block = [*_ATTENTION_NAMES, *_ROUTER_NAMES, *_EXPERT_NAMES, _NOT_IN_HF] if moe else [*_ATTENTION_NAMES, *_DENSE_NAMES]
    blocks = [f"layers.{i}.{suffix}" for i in range(n_layers) for suffix in block]
    return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]


def is_moe_names(fqns: list[str]) -> bool:
    """Whether FQNs are those of a Qwen3-MoE (MoE blocks rather than dense feed-forwards)."""
    return any(".moe." in fqn for fqn in fqns)


# ---------------------------------------------------------------------------------------------
# Tensors


def _rope_heads(suffix: str, args: Qwen3ModelArgs) -> int | None:
    """How many RoPE heads the rows of a block tensor hold (None: not permuted). The q/k norms are
    one head_dim vector, shared by every head, so one head."""
    return {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads,
            "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}.get(suffix)


def to_hf_tensors(fqn: str, w: torch.Tensor, args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """HF's tensors that store our tensor `fqn`: one (q/k rows and norms permuted, the rest as is),
    one view per expert for stacked experts, none for expert_bias."""
    name = to_hf_name(fqn)
    if name is None:
        return {}
    match = _OUR_BLOCK.match(fqn)
    suffix = match.group(2) if match else ""
    if suffix in _EXPERT_NAMES:
        return {name.replace("*", str(j)): w[j] for j in range(w.shape[0])}
    heads = _rope_heads(suffix, args)
    return {name: w if heads is None else rope_rows_to_hf(w, heads)}


def from_hf_tensors(fqn: str, parts: dict[str, torch.Tensor], args: Qwen3ModelArgs) -> torch.Tensor:
    """Our tensor `fqn` from the HF tensors `from_hf_names` relates to it: the inverse of
    `to_hf_tensors`, and stacked experts from transformers' fused tensors too."""
    match = _OUR_BLOCK.match(fqn)
    suffix = match.group(2) if match else ""
    if suffix in _EXPERT_NAMES:
        return stacked_experts_from_hf(fqn, suffix, parts, args.num_experts)
    (w,) = parts.values()  # every other HF name is one of ours
    heads = _rope_heads(suffix, args)
    return w if heads is None else rope_rows_from_hf(w, heads)


def tensors_without_hf(args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """expert_bias of every MoE block, as a fresh model starts it (zeros; float32, as MoE makes it)."""
    if not args.is_moe:
        return {}
    return {f"layers.{i}.{_NOT_IN_HF}": torch.zeros(args.num_experts) for i in range(args.n_layers)}


# ---------------------------------------------------------------------------------------------
# config.json


def hf_architecture(args: Qwen3ModelArgs) -> str:
    return MOE_ARCHITECTURE if args.is_moe else DENSE_ARCHITECTURE


def hf_config(args: Qwen3ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    """The `config.json` of a `Qwen3ForCausalLM` (dense `args`) or `Qwen3MoeForCausalLM` with the
    shapes and numerics of `args`, with the fields and spellings of the published releases
    (`num_experts`, where transformers 5 writes its alias `num_local_experts`).

    RoPE is written in both layouts, `rope_parameters` (transformers 5) and the older top-level
    `rope_theta` / `rope_scaling` (all transformers 4 reads), as Llama's converter does. `extra`
    adds or overrides fields (e.g. bos_token_id / eos_token_id, which depend on the tokenizer). The
    vocabulary is `vocab_size + vocab_padding`: HF has no notion of masked padding rows.
    """
    if args.norm_type not in ("rmsnorm", "fused_rmsnorm"):  # the same math
        raise ValueError(f"HF's Qwen3 uses RMSNorm; norm_type {args.norm_type!r} has no HF equivalent")
    config = {
        "architectures": [hf_architecture(args)],
        "model_type": "qwen3_moe" if args.is_moe else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size + args.vocab_padding,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if args.is_moe:
        config.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": args.moe_hidden_dim,
            "num_experts": args.num_experts,
            "num_experts_per_tok": args.top_k,
            "norm_topk_prob": args.norm_topk_prob,
            # HF's own load-balancing loss, off unless router logits are output; ours is set by [moe].
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    return {**config, **extra}


def model_args_from_hf_config(cfg: dict[str, Any]) -> Qwen3ModelArgs:
    """The args of the HF Qwen3 or Qwen3-MoE (by `model_type`) that `cfg`, a parsed config.json of
    transformers 4 or 5, describes.

    Absent fields get transformers' defaults, so the result computes what the reference library
    would. A field that changes the computation in a way this model cannot reproduce (biases,
    another activation, sliding-window attention, RoPE other than plain, dense blocks in an MoE,
    ...) is refused with a CheckpointError naming it.
    """
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json does not hold a JSON object")
    moe = _check_supported(cfg)
    dim, n_heads = positive_int(cfg, "hidden_size"), positive_int(cfg, "num_attention_heads")
    n_kv_heads = cfg.get("num_key_value_heads", _HF_DEFAULT_KV_HEADS[moe])
    if n_kv_heads is None and not moe:  # Qwen3Config: null means one key/value head per attention head
        n_kv_heads = n_heads
    n_kv_heads = positive_int({"num_key_value_heads": n_kv_heads}, "num_key_value_heads")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
    # Qwen3MoeConfig has no head_dim field of its own: transformers then uses hidden / heads.
    head_dim = positive_int(cfg, "head_dim", dim // n_heads if moe else 128)
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise CheckpointError(f"tie_word_embeddings {tie!r} is not true or false")
    common = dict(
        dim=dim, n_layers=positive_int(cfg, "num_hidden_layers"), n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, vocab_size=positive_int(cfg, "vocab_size"),
        norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6), rope_theta=_rope_theta(cfg),
        max_seq_len=positive_int(cfg, "max_position_embeddings", _HF_DEFAULT_MAX_POSITIONS),
        tie_word_embeddings=bool(tie),
    )
    if not moe:
        return Qwen3ModelArgs(**common, hidden_dim=positive_int(cfg, "intermediate_size"))
    n_experts = aliased_positive_int(cfg, ("num_experts", "num_local_experts"), _HF_DEFAULT_MOE["num_experts"])
    top_k = positive_int(cfg, "num_experts_per_tok", _HF_DEFAULT_MOE["num_experts_per_tok"])
    if top_k > n_experts:
        raise CheckpointError(f"num_experts_per_tok {top_k} is more than the {n_experts} experts")
    norm_topk = cfg.get("norm_topk_prob")
    norm_topk = _HF_DEFAULT_MOE["norm_topk_prob"] if norm_topk is None else norm_topk
    if not isinstance(norm_topk, bool):
        raise CheckpointError(f"norm_topk_prob {norm_topk!r} is not true or false")
    # intermediate_size sizes only the dense blocks an MoE has none of; kept for the way back.
    return Qwen3ModelArgs(**common, hidden_dim=positive_int(cfg, "intermediate_size", _HF_DEFAULT_MOE["intermediate_size"]),
                          num_experts=n_experts, top_k=top_k, moe_hidden_dim=positive_int(cfg, "moe_intermediate_size"),
                          norm_topk_prob=norm_topk)


def _check_supported(cfg: dict[str, Any]) -> bool:
    """Refuses what this model cannot compute; returns whether `cfg` is a Qwen3-MoE."""
    model_type = cfg.get("model_type")
    if model_type is None:  # as good as any guess: the MoE config is the one with experts
        model_type = "qwen3_moe" if any(k in cfg for k in ("num_experts", "num_local_experts")) else "qwen3"
    if model_type not in _MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not qwen3 or qwen3_moe")
    moe = _MODEL_TYPES[model_type]
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "moe_intermediate_size" if moe else "intermediate_size"]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    for key, accepted in {**_REQUIRED_HF_VALUES, **(_REQUIRED_MOE_VALUES if moe else {})}.items():
        value = cfg.get(key)
        if value is not None and value not in accepted:
            raise CheckpointError(f"{key} {value!r} is not supported (this Qwen3 computes with {accepted[0]!r})")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)):
        raise CheckpointError(f"layer_types {layer_types!r} is not supported (this Qwen3 has only full_attention layers)")
    if cfg.get("quantization_config") is not None:
        raise CheckpointError("quantization_config is not supported: the weights must be stored unquantized")
    return moe


def _rope_theta(cfg: dict[str, Any]) -> float:
    """RoPE theta, from `rope_parameters` and/or the older top-level `rope_theta` and `rope_scaling`.
    Only plain RoPE: the YaRN scaling Qwen3 documents for long contexts is refused. Every place that
    names a theta must name the same one: transformers 4 and 5 read different places."""
    dicts = rope_dicts(cfg)
    for key, raw, kind in dicts:
        if kind != "default":
            raise CheckpointError(f"{key} rope_type {kind!r} is not supported (this Qwen3 computes plain RoPE, 'default')")
        unknown = sorted(set(raw) - _ROPE_KEYS, key=str)
        if unknown:
            raise CheckpointError(f"{key} key {unknown[0]!r} is not understood for rope_type 'default'")
        partial = raw.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise CheckpointError(f"{key} partial_rotary_factor {partial!r} is not supported (this Qwen3 rotates "
                                  "whole heads)")
    return agreed_rope_theta(cfg, dicts, _HF_DEFAULT_ROPE_THETA)
