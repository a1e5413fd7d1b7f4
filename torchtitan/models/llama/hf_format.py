"""Llama <-> Hugging Face `LlamaForCausalLM` format: parameter names, q/k layouts and config.json (no I/O).

Two things differ between this project's Llama and Hugging Face's besides the names:
- RoPE pairs. Here each head's dims (2i, 2i+1) rotate together (Meta's interleaved layout); HF's
  `rotate_half` pairs dims i and i + head_dim/2. The rows of wq and wk are therefore permuted, per
  head, when converting; v, o and everything else keep their layout.
- The feed-forward size. Here it is derived from dim, multiple_of and ffn_dim_multiplier; HF stores
  `intermediate_size` directly. `model_args_from_hf_config` picks values the formula maps back to it.

config.json comes in two layouts: transformers 5 keeps RoPE settings in `rope_parameters`
({"rope_type", "rope_theta", scaling fields}); transformers 4 used top-level `rope_theta` and
`rope_scaling`. Both are read; fields that change the computation and are not understood are
refused (CheckpointError, one line naming the field), never defaulted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

from torchtitan.errors import CheckpointError
from torchtitan.models.hf_adapter import positive_int, positive_number, rope_rows_from_hf, rope_rows_to_hf
from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.model import ModelArgs, RopeScaling, ffn_hidden_dim

# Our FQN suffix within a block -> HF suffix within `model.layers.{i}`.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES_BACK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_TOP_NAMES_BACK = {hf: ours for ours, hf in _TOP_NAMES.items()}
_OUR_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Config fields that change the computation, with the values this model computes with (absent or
# null means the first). "swish" is transformers' other name for SiLU. Dropout changes training, so a
# fine-tuning run from a converted model would silently differ from one in transformers.
_REQUIRED_HF_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "attention_dropout": (0.0,),
    "partial_rotary_factor": (1.0,),
}
# The keys a RoPE dict may hold, per rope_type this model computes; any other key is refused.
_ROPE_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_ROPE_KEYS = {
    "default": _ROPE_COMMON_KEYS,
    "llama3": _ROPE_COMMON_KEYS | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
_HF_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names no theta at all


def to_hf_name(fqn: str) -> str:
    """The HF name of one of our parameter FQNs; KeyError for a name that is not a Llama parameter."""
    if fqn in _TOP_NAMES:
        return _TOP_NAMES[fqn]
    match = _OUR_BLOCK.match(fqn)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise KeyError(fqn)


def from_hf_name(name: str) -> str:
    """Our FQN for an HF `LlamaForCausalLM` parameter name; KeyError for any other name."""
    if name in _TOP_NAMES_BACK:
        return _TOP_NAMES_BACK[name]
    match = _HF_BLOCK.match(name)
    if match and match.group(2) in _BLOCK_NAMES_BACK:
        return f"layers.{match.group(1)}.{_BLOCK_NAMES_BACK[match.group(2)]}"
    raise KeyError(name)


def is_llama_name(fqn: str) -> bool:
    """Whether `fqn` names a parameter of this project's Llama."""
    try:
        to_hf_name(fqn)
    except KeyError:
        return False
    return True


def param_names(n_layers: int) -> list[str]:
    """Every parameter FQN of a Llama with `n_layers` blocks (the tied output projection included)."""
    blocks = [f"layers.{i}.{suffix}" for i in range(n_layers) for suffix in _BLOCK_NAMES]
    return ["tok_embeddings.weight", *blocks, "norm.weight", "output.weight"]


def _heads_of(fqn: str, args: ModelArgs) -> int | None:
    """How many RoPE heads the rows of `fqn` hold (None: not a RoPE projection)."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.n_kv_heads or args.n_heads
    return None


# The q/k row permutation is shared with the other families that convert to HF's rotate_half RoPE.
permute_for_hf = rope_rows_to_hf
unpermute_from_hf = rope_rows_from_hf


def to_hf_tensor(fqn: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Our tensor `fqn` in HF's layout (q/k rows permuted, the rest as is)."""
    heads = _heads_of(fqn, args)
    return w if heads is None else permute_for_hf(w, heads)


def from_hf_tensor(fqn: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF's tensor for our `fqn` in our layout (q/k rows un-permuted, the rest as is)."""
    heads = _heads_of(fqn, args)
    return w if heads is None else unpermute_from_hf(w, heads)


def hf_config(args: ModelArgs, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with the shapes and numerics of `args`.

    RoPE is written in both layouts: `rope_parameters` (what transformers 5 reads and writes) and
    the older top-level `rope_theta` / `rope_scaling` (all that transformers 4 reads; it keeps the
    other as a plain attribute). transformers 5 reads the pair without a warning, and
    `model_args_from_hf_config` refuses a config whose two layouts disagree.

    `extra` adds or overrides fields (e.g. bos_token_id / eos_token_id, which depend on the tokenizer).
    The vocabulary is `vocab_size + vocab_padding`: HF has no notion of masked padding rows.
    """
    if args.norm_type != "rmsnorm":
        raise ValueError(f"HF's Llama uses RMSNorm; norm_type {args.norm_type!r} has no HF equivalent")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size + args.vocab_padding,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default" if args.rope_scaling is None else "llama3", "rope_theta": args.rope_theta,
                            **_hf_rope_scaling_fields(args.rope_scaling)},
        "rope_theta": args.rope_theta,
        "rope_scaling": {"rope_type": "llama3", **_hf_rope_scaling_fields(args.rope_scaling)} if args.rope_scaling else None,
        "max_position_embeddings": _hf_max_positions(args),
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    return {**config, **extra}


def _hf_rope_scaling_fields(s: RopeScaling | None) -> dict[str, Any]:
    if s is None:
        return {}
    return {"factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}


def _hf_max_positions(args: ModelArgs) -> int:
    """`max_position_embeddings` for `args`. Our max_seq_len is the training sequence length; with
    llama3 scaling that is usually below the original context the scaling stretches, and
    transformers warns unless max_position_embeddings exceeds original_max_position_embeddings.
    So a scaled model advertises the stretched context (original x factor, at least original + 1)."""
    s = args.rope_scaling
    if s is None:
        return args.max_seq_len
    original = s.original_max_position_embeddings
    return max(args.max_seq_len, math.ceil(original * s.factor), original + 1)


def model_args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of the HF Llama that `cfg` (a parsed config.json, of transformers 4 or 5) describes.

    Absent fields get transformers' own defaults, so the result computes what the reference library
    would. A field that changes the computation in a way this model cannot reproduce (another
    architecture, biases, another activation, a head_dim other than hidden/heads, a RoPE type other
    than default or llama3, a RoPE key not understood...) is refused with a CheckpointError naming it.
    """
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json does not hold a JSON object")
    _check_supported(cfg)
    dim, n_heads = positive_int(cfg, "hidden_size"), positive_int(cfg, "num_attention_heads")
    n_kv_heads = positive_int(cfg, "num_key_value_heads", n_heads)
    max_positions = positive_int(cfg, "max_position_embeddings", 2048)
    rope_theta, rope_scaling = _rope_from_hf(cfg, max_positions)
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise CheckpointError(f"tie_word_embeddings {tie!r} is not true or false")
    args = ModelArgs(
        dim=dim,
        n_layers=positive_int(cfg, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        vocab_size=positive_int(cfg, "vocab_size"),
        norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=max_positions,
        tie_word_embeddings=bool(tie),
    )
    return with_ffn_hidden_dim(args, positive_int(cfg, "intermediate_size"))


def _check_supported(cfg: dict[str, Any]) -> None:
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if k not in cfg]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    if cfg.get("model_type", "llama") != "llama":
        raise CheckpointError(f"model_type {cfg['model_type']!r} is not llama")
    for key, accepted in _REQUIRED_HF_VALUES.items():
        value = cfg.get(key)
        if value is not None and value not in accepted:
            raise CheckpointError(f"{key} {value!r} is not supported (this Llama computes with {accepted[0]!r})")
    if cfg.get("quantization_config") is not None:
        raise CheckpointError("quantization_config is not supported: the weights must be stored unquantized")
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = positive_int(cfg, "num_key_value_heads", heads)
    hidden = positive_int(cfg, "hidden_size")
    if hidden % heads or heads % kv_heads:
        raise CheckpointError(f"num_attention_heads {heads} does not divide hidden_size {hidden} or is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise CheckpointError(f"head_dim {head_dim!r} is not hidden_size / num_attention_heads ({hidden // heads}), "
                              "which this Llama requires")


def _rope_from_hf(cfg: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling, from today's `rope_parameters` or the older top-level `rope_theta` and
    `rope_scaling`. Where both layouts are present they must agree: transformers 4 reads only the
    older one and transformers 5 prefers `rope_scaling` when set, so two releases would compute
    different models from one file."""
    top_theta = cfg.get("rope_theta")
    read: dict[str, tuple[float, RopeScaling | None]] = {}
    if cfg.get("rope_parameters") is not None:
        read["rope_parameters"] = _read_rope_dict("rope_parameters", cfg["rope_parameters"], top_theta, max_positions)
    if not read or top_theta is not None or cfg.get("rope_scaling") is not None:
        read["rope_theta/rope_scaling"] = _read_rope_dict("rope_scaling", cfg.get("rope_scaling") or {}, top_theta,
                                                          max_positions)
    (first_name, first), *others = read.items()
    for name, other in others:
        if other != first:
            raise CheckpointError(f"{first_name} ({_describe_rope(*first)}) and {name} ({_describe_rope(*other)}) disagree; "
                                  "keep one layout, or make them equal")
    return first


def _describe_rope(theta: float, scaling: RopeScaling | None) -> str:
    if scaling is None:
        return f"theta {theta:g}, no scaling"
    return (f"theta {theta:g}, llama3 factor {scaling.factor:g}, low_freq_factor {scaling.low_freq_factor:g}, "
            f"high_freq_factor {scaling.high_freq_factor:g}, original_max_position_embeddings "
            f"{scaling.original_max_position_embeddings}")


def _read_rope_dict(name: str, raw: Any, top_theta: Any, max_positions: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from one RoPE dict (`rope_parameters`, or `rope_scaling` with the top-level
    `rope_theta`); transformers' defaults for what is absent, a refusal for what is not understood."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{name} {raw!r} is not a JSON object")
    kind = raw.get("rope_type", raw.get("type", "default"))  # `type` is the older spelling
    if "type" in raw and "rope_type" in raw and raw["type"] != raw["rope_type"]:
        raise CheckpointError(f"{name} type {raw['type']!r} and rope_type {raw['rope_type']!r} disagree")
    if kind not in _ROPE_KEYS:
        raise CheckpointError(f"{name} rope_type {kind!r} is not supported (only default and llama3 RoPE are)")
    unknown = sorted(set(raw) - _ROPE_KEYS[kind], key=str)
    if unknown:
        raise CheckpointError(f"{name} key {unknown[0]!r} is not understood for rope_type {kind!r}")
    partial = raw.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise CheckpointError(f"{name} partial_rotary_factor {partial!r} is not supported (this Llama rotates whole heads)")
    if "rope_theta" in raw and top_theta is not None and raw["rope_theta"] != top_theta:
        raise CheckpointError(f"{name} rope_theta {raw['rope_theta']!r} and the top-level rope_theta {top_theta!r} disagree")
    default_theta = _HF_DEFAULT_ROPE_THETA if top_theta is None else top_theta  # as transformers 5 fills it in
    theta = positive_number(raw, "rope_theta", default_theta, where=f"{name} " if "rope_theta" in raw else "")
    if kind == "default":
        return theta, None
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if raw.get(key) is None]
    if missing:
        raise CheckpointError(f"{name} lacks {missing[0]}, which llama3 RoPE scaling needs")
    fields = {key: positive_number(raw, key, where=f"{name} ") for key in ("factor", "low_freq_factor", "high_freq_factor")}
    # Like transformers, the original context defaults to max_position_embeddings.
    original = positive_int(raw, "original_max_position_embeddings", max_positions, where=f"{name} ")
    return theta, RopeScaling(**fields, original_max_position_embeddings=original)


def _known_ffn_settings(dim: int) -> list[tuple[int, float | None]]:
    """(multiple_of, ffn_dim_multiplier) pairs of the published flavors, so that a converted
    config gets the familiar values when they fit (they do for every Llama 2 and 3 release).
    Flavors of the same width come first: several pairs can give the same size."""
    flavors = (*llama2_configs.values(), *llama3_configs.values())
    same_width = [(a.multiple_of, a.ffn_dim_multiplier) for a in flavors if a.dim == dim]
    return list(dict.fromkeys([*same_width, (256, None), *((a.multiple_of, a.ffn_dim_multiplier) for a in flavors)]))


def with_ffn_hidden_dim(args: ModelArgs, hidden: int) -> ModelArgs:
    """`args` with multiple_of / ffn_dim_multiplier chosen so that `ffn_hidden_dim` gives `hidden`."""
    for multiple_of, multiplier in _known_ffn_settings(args.dim):
        candidate = dataclasses.replace(args, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if ffn_hidden_dim(candidate) == hidden:
            return candidate
    # Any size: round up to a multiple of `hidden` itself, after scaling the base size down to at
    # most `hidden` when it is larger (the int() truncation then lands on hidden or hidden - 1).
    base = int(2 * 4 * args.dim / 3)
    multiplier = None if base <= hidden else hidden / base
    candidate = dataclasses.replace(args, multiple_of=hidden, ffn_dim_multiplier=multiplier)
    if hidden <= 0 or ffn_hidden_dim(candidate) != hidden:
        raise ValueError(f"cannot express a feed-forward size of {hidden} for dim {args.dim}")
    return candidate
