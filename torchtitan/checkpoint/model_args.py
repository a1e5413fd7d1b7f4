"""A model's args as checkpoints record them: to JSON and back, and which differences between two models' args matter.

Every checkpoint's manifest records the args of the model that wrote it (`Manifest.model_args`):
training runs record their flavor's, and scripts/convert_checkpoint.py the ones a Hugging Face
config.json or a named flavor describes. A tool reading a checkpoint therefore needs no registered
flavor to rebuild its model (`args_from_record`), and a run can tell what it would compute
differently from the model whose weights it loads.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Mapping

# How a difference in one field of the args matters when weights are loaded into another model.
# Fields that change what the model computes but not its tensors' shapes: a difference is reported,
# not refused (continued training may change RoPE on purpose).
NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "norm_eps", "norm_type")
# Fields that change the model's tensor shapes, so a difference shows as tensors missing, extra or of
# another shape (which exclude_from_loading / allow_partial_load can deliberately leave out). A
# difference in any other shape-relevant field (a MoE's experts per token, say) is refused by name.
SHAPE_VISIBLE_FIELDS = ("dim", "n_layers", "vocab_size", "tie_word_embeddings", "hidden_dim", "num_experts",
                        "moe_hidden_dim")
# Fields of the attention head layout: equal shapes can hide a difference (dim 256 as 16 heads of 16
# or 8 of 32), and the query and key rows are ordered per head for RoPE, so no partial load can use
# such weights.
HEAD_FIELDS = ("n_heads", "n_kv_heads", "head_dim")
# Fields that are the run's own business: the sequence length it trains on, initialisation and
# training-only settings, and the vocabulary padding (checked by the tensor shapes).
# Also fields that are only one way of writing a size (Llama's feed-forward size from multiple_of
# and ffn_dim_multiplier: config.json gives the size itself), which the tensor shapes check.
RUN_FIELDS = ("max_seq_len", "depth_init", "moe_aux_loss_coef", "moe_bias_update_rate", "vocab_padding",
              "multiple_of", "ffn_dim_multiplier")


def args_record(args: Any) -> dict[str, Any]:
    """A model's args dataclass as JSON values, as the manifest stores them."""
    if args is None or not dataclasses.is_dataclass(args):
        return {}
    return json.loads(json.dumps(dataclasses.asdict(args), default=str))


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type names (`RopeScaling | None` -> RopeScaling), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)
    return None


def args_from_record(base: Any, record: dict[str, Any]) -> Any:
    """`base` (a flavor's args, or the family's defaults) with the values `record` (from
    `args_record`) holds: the inverse of args_record for the fields `base` has. Nested dataclasses
    come back from their dicts, tuples from their lists; fields `base` lacks are ignored (a manifest
    of another version)."""
    try:
        hints = typing.get_type_hints(type(base))
    except (NameError, TypeError):  # an annotation naming what only type checkers import
        hints = {}
    updates = {}
    for f in dataclasses.fields(base):
        if f.name not in record:
            continue
        value, current = record[f.name], getattr(base, f.name)
        nested = _dataclass_in(hints.get(f.name))
        if isinstance(value, dict) and nested is not None:
            value = args_from_record(nested(), value) if not dataclasses.is_dataclass(current) else \
                args_from_record(current, value)
        elif isinstance(value, list) and isinstance(current, tuple):
            value = tuple(value)
        updates[f.name] = value
    return dataclasses.replace(base, **updates)


def differences(saved: dict[str, Any], ours: dict[str, Any], saved_is: str, ours_is: str) -> dict[str, str]:
    """Field -> `name X (saved_is) vs Y (ours_is)` for each field, outside RUN_FIELDS, in which two
    args records differ (a key/value head count of None is one per attention head)."""
    found = {}
    for name in sorted(saved.keys() & ours.keys()):
        if name in RUN_FIELDS:
            continue
        a, b = saved[name], ours[name]
        if name == "n_kv_heads":
            a, b = a or saved.get("n_heads"), b or ours.get("n_heads")
        if a != b:
            found[name] = f"{name} {a} ({saved_is}) vs {b} ({ours_is})"
    return found


def checkpoint_args(flavors: Mapping[str, Any], flavor: str | None, record: dict[str, Any]) -> Any | None:
    """The args of the model a checkpoint of the family with `flavors` (TrainSpec.config) holds: the
    args it recorded over those of its flavor, or over the family's defaults when its flavor is not
    registered (weights converted from a Hugging Face folder); its flavor's alone when it recorded
    none (an older manifest); None when neither tells."""
    base = flavors.get(flavor) if flavor is not None else None
    if not record:
        return base
    if base is None:
        some = next(iter(flavors.values()))
        try:
            base = type(some)()  # the family's defaults: fields the record lacks are not one flavor's
        except TypeError:  # args without defaults: every field the record has is replaced anyway
            base = some
    return args_from_record(base, record)
