"""HFAdapter: what a model family tells the checkpoint converter about its Hugging Face format.

torchtitan/checkpoint/hf_folder.py (safetensors folders, for any family) and
scripts/convert_checkpoint.py learn a family's parameter names, tensor layouts and config.json
only through the adapter its TrainSpec registers (`TrainSpec.hf_adapter`), so neither imports a
model family. Below, `args` is the family's model args (a dataclass, like a TrainSpec flavor).
Refusals of what the family cannot represent raise CheckpointError (torchtitan.errors) with one
line naming the field or tensor.

Names need not map one to one. Mostly one of our tensors is one HF tensor, but:
- HF may store one of ours as several tensors (Qwen3-MoE's stacked experts `moe.experts.w1`, shape
  (experts, hidden, dim), are one `mlp.experts.{j}.gate_proj.weight` per expert): `to_hf_tensors`
  splits it and `from_hf_tensors` merges the parts back;
- one HF tensor may hold parts of several of ours (transformers' fused `gate_up_proj`, our w1 and
  w3): `from_hf_names` names each of them, and each one's `from_hf_tensors` takes its part. A family
  that also writes such a tensor (gpt-oss, whose only HF layout is fused) gives, from each one's
  `to_hf_tensors`, its part under the fused name, and has `to_hf_fused(name, parts, args)`, which
  joins the parts (our FQN -> part) once all are there (torchtitan/checkpoint/hf_folder.py:
  `hf_tensors_of`);
- a folder may store a tensor quantized (DeepSeek-V3's fp8 weights beside their scales, gpt-oss's
  MXFP4 blocks and scales): `from_hf_names` relates the scales to the same FQNs, and
  `from_hf_tensors` dequantizes; exports are never quantized;
- we may keep a tensor HF has no counterpart for (the auxiliary-loss-free `moe.expert_bias`):
  `to_hf_name` gives None, an export leaves it out and an import fills in `tensors_without_hf`;
- HF's names may depend on the args (DeepSeek-V3 numbers its MTP modules after the last block):
  such an adapter sets `from_hf_names_takes_args = True`, and its `from_hf_names` then takes the
  args as a second argument, which torchtitan/checkpoint/hf_folder.py passes when it has them.
- a folder may lack what its config.json promises for a reason the family knows (DeepSeek-V3's MTP
  layers, which transformers' save_pretrained promises but never writes): such an adapter has
  `promised_but_missing(args, fqns)`, the line that says why and what to change, or None; the
  converter and a training run's Hugging Face load (`hf_folder.promised_but_missing`) lead with it.
This module also holds the q/k row permutation that every family with HF's `rotate_half` RoPE needs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from torchtitan.errors import CheckpointError

if TYPE_CHECKING:
    import torch


class HFAdapter(Protocol):
    family: str  # the family in refusals: "... are not Llama parameters"

    def hf_architecture(self, args: Any) -> str:
        """HF's model class for `args`, as config.json's `architectures` names it ("LlamaForCausalLM";
        Qwen3 has a dense and an MoE one)."""
        ...

    def to_hf_name(self, fqn: str) -> str | None:
        """HF's name for one of our FQNs; for a tensor HF stores as several, their names with `*`
        for the part's index (as transformers' own conversion mappings write them); None for a tensor
        of ours with no HF counterpart; KeyError for a name that is no tensor of the family."""
        ...

    def from_hf_names(self, name: str) -> tuple[str, ...]:
        """Our FQNs that HF's tensor `name` is, or holds a part of (usually one); KeyError for any
        other name."""
        ...

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        """Every FQN of a whole model with as many blocks as `fqns` reach (a tied output projection
        included), of the kind `fqns` are (dense or MoE, say): what a checkpoint holding `fqns` must
        hold. `fqns` are the family's names."""
        ...

    def to_hf_tensors(self, fqn: str, w: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
        """HF's tensors (name -> tensor in HF's layout, e.g. RoPE rows reordered) that store our
        tensor `fqn`: usually one, which may be `w` itself; several for a tensor HF stores split
        (views of `w`); none for one HF has no counterpart for."""
        ...

    def from_hf_tensors(self, fqn: str, parts: dict[str, torch.Tensor], args: Any) -> torch.Tensor:
        """Our tensor `fqn` in our layout from the HF tensors that `from_hf_names` relates to it
        (name -> tensor, all of a folder's): the inverse of `to_hf_tensors`. CheckpointError when
        parts are missing or do not fit `args`."""
        ...

    def tensors_without_hf(self, args: Any) -> dict[str, torch.Tensor]:
        """Our tensors that HF has no counterpart for (`to_hf_name` None), as a freshly initialised
        model holds them: what an import adds. Usually none."""
        ...

    def ties_embeddings(self, args: Any) -> bool:
        """Whether the output projection is the embedding. HF then stores it once, as the embedding;
        our model keeps it under both names."""
        ...

    def hf_config(self, args: Any, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        """The config.json of HF's model with the shapes and numerics of `args`; `extra` adds or
        overrides fields (bos_token_id / eos_token_id, which depend on the tokenizer)."""
        ...

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> Any:
        """The model args that a parsed config.json describes; CheckpointError for a field that
        changes the computation in a way this family cannot reproduce."""
        ...

    def args_with_shapes(self, base: Any | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> Any:
        """`base` (the args of the checkpoint's flavor; None when it has none, the family's
        defaults) with every size the tensor `shapes` (our FQN -> shape) tell. Head counts may not
        show in shapes: `n_heads` and `n_kv_heads` are the user's, None where not given (the
        converter's --n-heads and --n-kv-heads, which the refusals name)."""
        ...


_BLOCK = re.compile(r"^layers\.(\d+)\.")


def blocks_reached(fqns: Iterable[str]) -> int:
    """How many blocks our FQNs reach (`layers.{i}.*`: the highest i, plus one): what
    `whole_model_names` sizes a model by."""
    layers = [int(m.group(1)) for m in map(_BLOCK.match, fqns) if m]
    return max(layers) + 1 if layers else 0


# ---------------------------------------------------------------------------------------------
# RoPE layouts


def rope_rows_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (or the features of a per-head q/k norm, as `n_heads` 1 and a
    vector) from this project's interleaved RoPE pairs (2i, 2i+1) to HF's `rotate_half` halves
    (i, i + head_dim/2), head by head."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def rope_rows_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `rope_rows_to_hf`: HF's rotate_half rows back to interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)


# Readers of config.json fields shared by the families' hf_format modules; refusals name the field.


def positive_int(raw: dict[str, Any], key: str, default: int | None = None, where: str = "") -> int:
    """raw[key] as a positive int; `default` (transformers' default for it) when absent or null.
    `where` prefixes the field's name in the refusal (e.g. "rope_parameters ")."""
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}{key} {value!r} is not a positive integer")
    return value


def positive_number(raw: dict[str, Any], key: str, default: float | None = None, where: str = "") -> float:
    """raw[key] as a positive float, like `positive_int`."""
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{where}{key} {value!r} is not a positive number")
    return float(value)


def aliased_positive_int(cfg: dict[str, Any], keys: tuple[str, str], default: int) -> int:
    """A positive int that config.json may give under either of two names (Qwen3-MoE's published
    `num_experts` and transformers 5's alias `num_local_experts`, say); where both are set they must
    agree, since each reader of the file believes its own."""
    given = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if len(given) == 2 and given[keys[0]] != given[keys[1]]:
        raise CheckpointError(f"{keys[0]} {given[keys[0]]!r} and {keys[1]} {given[keys[1]]!r} disagree")
    key = next(iter(given), keys[0])
    return positive_int({key: given.get(key, default)}, key)


# RoPE settings in config.json live in two places: transformers 5's `rope_parameters` and the older
# top-level `rope_theta` / `rope_scaling` (what transformers 4 and most published files hold).


def rope_dicts(cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(place, its dict, its rope_type) for each of `rope_parameters` and `rope_scaling` that is set;
    `type` is the older spelling of `rope_type`, "default" when neither is given."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        raw = cfg.get(key)
        if raw is None:
            continue
        if not isinstance(raw, dict):
            raise CheckpointError(f"{key} {raw!r} is not a JSON object")
        if "type" in raw and "rope_type" in raw and raw["type"] != raw["rope_type"]:
            raise CheckpointError(f"{key} type {raw['type']!r} and rope_type {raw['rope_type']!r} disagree")
        found.append((key, raw, raw.get("rope_type", raw.get("type", "default"))))
    return found


def agreed_rope_theta(cfg: dict[str, Any], dicts: list[tuple[str, dict[str, Any], str]], default: float) -> float:
    """The RoPE theta that every place naming one names (the top-level `rope_theta` and those of
    `dicts`, from `rope_dicts`): transformers 4 and 5 read different places, so they must agree;
    `default` (the family's in transformers) when none does."""
    thetas: dict[str, float] = {}
    if cfg.get("rope_theta") is not None:
        thetas["rope_theta"] = positive_number(cfg, "rope_theta")
    for key, raw, _ in dicts:
        if raw.get("rope_theta") is not None:
            thetas[f"{key} rope_theta"] = positive_number(raw, "rope_theta", where=f"{key} ")
    (first, theta), *others = [*thetas.items()] or [("", default)]
    for name, other in others:
        if other != theta:
            raise CheckpointError(f"{first} {theta:g} and {name} {other:g} disagree; keep one, or make them equal")
    return theta


def check_yarn_dict(key: str, raw: dict[str, Any], kind: str, family: str, keys: set[str],
                    fixed: tuple[tuple[str, tuple[Any, ...]], ...]) -> None:
    """Refuses, in one line naming it, what a RoPE dict of a family computing plain RoPE or YaRN
    cannot hold: another rope_type, a key outside `keys`, a `fixed` field with a value other than
    those it accepts (absent: None)."""
    if kind not in ("default", "yarn"):
        raise CheckpointError(f"{key} rope_type {kind!r} is not supported (this {family} computes plain RoPE or YaRN)")
    unknown = sorted(set(raw) - keys, key=str)
    if unknown:
        raise CheckpointError(f"{key} key {unknown[0]!r} is not understood")
    for field, ok in fixed:
        if raw.get(field) not in ok:
            raise CheckpointError(f"{key} {field} {raw[field]!r} is not supported")


def agreed_scaling(scalings: dict[str, Any]) -> Any:
    """The RoPE scaling that `rope_parameters` and `rope_scaling` (place -> what it describes) both
    describe, where both are set; the one set, or None."""
    if len(scalings) == 2 and scalings["rope_parameters"] != scalings["rope_scaling"]:
        raise CheckpointError("rope_parameters and rope_scaling describe different RoPE scalings; keep one, or make "
                              "them equal")
    return next(iter(scalings.values()), None)


def yarn_fields(raw: dict[str, Any], key: str, max_seq_len: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """YaRN's settings of a RoPE dict as transformers reads them: `original_max_position_embeddings`
    (max_position_embeddings when absent), `factor` (max_position_embeddings / original when absent),
    `beta_fast` 32 and `beta_slow` 1 when absent or 0 (transformers: `or 32`, `or 1`), and each of
    `extra` (DeepSeek's mscale fields) 0 when absent, every one a non-negative number."""
    where = f"{key} "
    original = positive_int(raw, "original_max_position_embeddings", max_seq_len, where)
    values: dict[str, Any] = {"factor": positive_number(raw, "factor", max_seq_len / original, where),
                              "original_max_position_embeddings": original}
    for field, default in (("beta_fast", 32.0), ("beta_slow", 1.0), *((name, 0.0) for name in extra)):
        value = raw.get(field)
        if value is None or (value == 0 and field.startswith("beta")):
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise CheckpointError(f"{key} {field} {value!r} is not a non-negative number")
        values[field] = float(value)
    return values


def check_common_fields(cfg: dict[str, Any], model_type: str, family: str,
                        required_values: dict[str, tuple[Any, ...]]) -> None:
    """The refusals every family's config.json reader starts with, each one line naming the field:
    another model_type (absent: taken as `model_type`), a missing size, a field whose value is not
    one of those `required_values` accepts (absent or null: the first, what `family` computes with),
    and tied embeddings (for a family whose output projection is its own)."""
    found = cfg.get("model_type", model_type)
    if found != model_type:
        raise CheckpointError(f"model_type {found!r} is not {model_type}")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    for key, accepted in required_values.items():
        value = cfg.get(key)
        if value is not None and value not in accepted:
            raise CheckpointError(f"{key} {value!r} is not supported (this {family} computes with {accepted[0]!r})")
    if cfg.get("tie_word_embeddings"):
        raise CheckpointError(f"tie_word_embeddings true is not supported: {family}'s output projection is its own")
