"""Llama <-> Hugging Face `LlamaForCausalLM` format: parameter names, q/k layouts and config.json (no I/O).

Two things differ between this project's Llama and Hugging Face's besides the names:
- RoPE pairs. Here each head's dims (2i, 2i+1) rotate together (Meta's interleaved layout); HF's
  `rotate_half` pairs dims i and i + head_dim/2. The rows of wq and wk are therefore permuted, per
  head, when converting; v, o and everything else keep their layout.
- The feed-forward size. Here it is derived from dim, multiple_of and ffn_dim_multiplier; HF stores
  `intermediate_size` directly. `model_args_from_hf_config` picks values the formula maps back to it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

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

# Config fields that change the computation in ways this model cannot reproduce, with the value it needs.
_REQUIRED_HF_VALUES = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


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


def permute_for_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from interleaved pairs (2i, 2i+1) to HF's halves (i, i + head_dim/2)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_for_hf`: HF's rotate_half rows back to interleaved pairs."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


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
        "rope_theta": args.rope_theta,
        "rope_scaling": _hf_rope_scaling(args.rope_scaling),
        "max_position_embeddings": args.max_seq_len,
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


def _hf_rope_scaling(s: RopeScaling | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position_embeddings}


def model_args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of the HF Llama that `cfg` (a parsed config.json) describes; ValueError when this
    model cannot reproduce it (another architecture, biases, a head_dim other than hidden/heads, ...)."""
    _check_supported(cfg)
    dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    args = ModelArgs(
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling")),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return with_ffn_hidden_dim(args, int(cfg["intermediate_size"]))


def _check_supported(cfg: dict[str, Any]) -> None:
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type {cfg['model_type']!r} is not llama")
    for key, needed in _REQUIRED_HF_VALUES.items():
        if cfg.get(key, needed) != needed:
            raise ValueError(f"{key} {cfg[key]!r} is not supported (this Llama needs {needed!r})")
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if int(cfg["hidden_size"]) % heads or heads % kv_heads:
        raise ValueError(f"{heads} attention heads do not divide hidden_size {cfg['hidden_size']} or are not a multiple of "
                         f"{kv_heads} key/value heads")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * int(cfg["num_attention_heads"]) != int(cfg["hidden_size"]):
        raise ValueError(f"head_dim {head_dim} is not hidden_size / num_attention_heads, which this Llama requires")


def _rope_scaling_from_hf(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only llama3 frequency scaling is)")
    defaults = RopeScaling()
    return RopeScaling(**{f.name: type(getattr(defaults, f.name))(raw.get(f.name, getattr(defaults, f.name)))
                          for f in dataclasses.fields(RopeScaling)})


def _known_ffn_settings(dim: int) -> list[tuple[int, float | None]]:
    """(multiple_of, ffn_dim_multiplier) pairs of the published flavors, so that a converted
    config gets the familiar values when they fit (they do for every Llama 2 and 3 release).
    Flavors of the same width come first: several pairs can give the same size."""
    from torchtitan.models.llama import llama2_configs, llama3_configs  # here: the package may import this module

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
