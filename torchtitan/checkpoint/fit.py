"""Whether a checkpoint fits the model it is about to be loaded into, decided before any tensor is read.

DCP loads whatever keys the two sides share and, without this check, silently drops the rest: an
untied checkpoint resumed as a tied flavor loses its output projection and that weight's optimizer
state; Llama 3 weights start a Llama 2 run. Everything here works from the checkpoint's DCP
metadata (names, global shapes) and its manifest (which model wrote it), so it costs no tensor
reads. The verdict is one line naming the first difference, or, for a deliberate partial load
(`checkpoint.exclude_from_loading`, `checkpoint.allow_partial_load`), the set of keys not to load.

Each rank knows only its own states (a pipeline stage holds some parameters, a ZeRO-1 replica some
optimizer state), so every rank reports what it sees and all decide from the same gathered reports.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.model_args import HEAD_FIELDS, NUMERIC_FIELDS, SHAPE_VISIBLE_FIELDS, differences
from torchtitan.parallelisms.lora_linear import is_adapter_name

logger = logging.getLogger(__name__)

# Entries whose presence in the checkpoint alone must match the model: parameters and their
# optimizer state. (Optimizer hyperparameters, `param_groups.*`, come and go with PyTorch versions;
# the data position and RNG states have their own rules in manager.py.)
_CHECKED_EXTRAS = ("model.", "optimizer.state.")
# Model arguments that are run settings rather than properties of the weights.
_NOT_IN_WEIGHTS = {"max_seq_len", "depth_init"}
_EXAMPLES = 3  # keys named per kind of difference in a warning
_SHARED_KEYS = 100  # keys per kind a rank sends the others: enough to name and count, bounded at scale


@dataclasses.dataclass
class ModelRecord:
    """Which model wrote a checkpoint, or which one this run trains; None / {} where unknown
    (a DCP folder from another tool, a manifest written before these fields existed)."""

    name: str | None = None
    flavor: str | None = None
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # the model's args dataclass, as JSON
    tied: dict[str, str] | None = None  # parameter name -> the parameter whose weight it shares
    converted_from: str | None = None  # Manifest.converted_from: weights made by scripts/convert_checkpoint.py
    lora: dict[str, Any] | None = None  # Manifest.lora: the adapters' rank and targets (LoRA runs)

    def __str__(self) -> str:
        return " ".join(str(v) for v in (self.name, self.flavor) if v) or "an unknown model"


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that share their weight with an earlier name (`output.weight` ->
    `tok_embeddings.weight` for tied embeddings). Read from a whole model: a pipeline stage holds
    only one side of the pair."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def build_on_meta(model_cls: Any, args: Any) -> nn.Module | None:
    """The model of `args` on the meta device (no memory), to read its structure; None if the
    class cannot be built from its args."""
    build = getattr(model_cls, "from_model_args", None)
    if build is None or args is None:
        return None
    with torch.device("meta"):
        return build(args)


def checkpoint_record(manifest: Manifest | None, lookup: Callable[[str, str], Any] | None = None) -> ModelRecord:
    """The model that wrote a checkpoint. Manifests record its args and tied weights; for older
    ones the tied weights come from the registered flavor (`lookup(name, flavor)` -> (class, args)),
    when it is registered."""
    if manifest is None or not manifest.model:
        return ModelRecord()
    record = ModelRecord(manifest.model.get("name"), manifest.model.get("flavor"), dict(manifest.model_args),
                         None if manifest.tied is None else dict(manifest.tied), manifest.converted_from, manifest.lora)
    if record.tied is None and lookup is not None and record.name and record.flavor:
        try:
            model = build_on_meta(*lookup(record.name, record.flavor))
        except Exception:  # not registered in this process, or not buildable: stays unknown
            model = None
        if model is not None:
            record.tied = tied_aliases(model)
    return record


def matches(prefix: str, key: str) -> bool:
    """`prefix` names `key` whole or up to a dot: `output` names `output.weight`, not `outputs`."""
    return key == prefix or key.startswith(prefix + ".")


def parameter_part(key: str) -> str | None:
    """The parameter-name part of a DCP key (`model.output.weight` -> `output.weight`,
    `optimizer.state.output.weight.exp_avg` -> `output.weight.exp_avg`); None for other states."""
    for head in ("model.", "optimizer.state.", "optimizer.param_groups."):
        if key.startswith(head):
            return key[len(head):]
    return None


def excluded_by(entries: list[str], key: str, top_level: bool = False) -> str | None:
    """The `checkpoint.exclude_from_loading` entry that names `key`: a whole DCP key prefix
    (`optimizer`, `model.layers.7`) or a parameter prefix (`output`), which also names that
    parameter's optimizer state."""
    param = key if top_level else parameter_part(key)
    for entry in entries:
        if matches(entry, key) or (param is not None and matches(entry, param)):
            return entry
    return None


def _is_adapter(key: str) -> bool:
    """Whether a DCP key is a LoRA adapter's weight or its optimizer state (`model.X.lora_a.weight`,
    `optimizer.state.X.lora_b.weight.exp_avg`, ...)."""
    return is_adapter_name(parameter_part(key) or key)


def _label(key: str) -> str:
    return key.removeprefix("model.")


def _leaves(prefix: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, item in value.items() for k, v in _leaves(f"{prefix}.{key}" if prefix else key, item).items()}


def _args_difference(saved: dict[str, Any], ours: dict[str, Any], limit: int = 4) -> str:
    saved, ours = _leaves("", saved), _leaves("", ours)
    diffs = [f"{k} {saved[k]} vs {ours[k]}" for k in sorted(saved.keys() & ours.keys())
             if k.split(".")[0] not in _NOT_IN_WEIGHTS and saved[k] != ours[k]]
    return ", ".join(diffs[:limit]) + (", ..." if len(diffs) > limit else "")


def _examples(keys: list[str], count: int | str) -> str:
    shown = ", ".join(_label(k) for k in keys[:_EXAMPLES])
    if isinstance(count, str):  # only a lower bound is known
        return f"{shown} and more ({count} entries)"
    return shown + (f" and {count - _EXAMPLES} more" if count > _EXAMPLES else "")


@dataclasses.dataclass
class LoadPlan:
    """What this rank loads: every key of its states except `skip`."""

    skip: set[str]
    warnings: list[str]


class FitCheck:
    """Compares what this run would load (`expected`: DCP key -> global shape, None for
    non-tensor entries, per rank) with a checkpoint's metadata. `report()` runs on every rank;
    `decide()` takes every rank's report and raises CheckpointError or returns the LoadPlan."""

    def __init__(self, path: str, metadata: Metadata, saved: ModelRecord, ours: ModelRecord, states: list[str],
                 exclude: list[str], allow_partial: bool, top_level: bool = False):
        self.path, self.saved, self.ours, self.states = path, saved, ours, states
        self.exclude, self.allow_partial, self.top_level = exclude, allow_partial, top_level
        self.entries = metadata.state_dict_metadata
        # Checkpoint keys that a model entry or optimizer state must claim, in one order on every rank.
        loaded_prefixes = tuple(p for p in _CHECKED_EXTRAS if p.split(".")[0] in states)
        self.checked = sorted(k for k in self.entries if top_level or k.startswith(loaded_prefixes))
        self._index = {k: i for i, k in enumerate(self.checked)}

    def _param(self, key: str) -> str | None:
        return key if self.top_level else parameter_part(key)

    def _is_alias(self, key: str) -> bool:
        param = self._param(key)
        return param is not None and any(matches(alias, param) for alias in (self.ours.tied or {}))

    def _in_tied_pair(self, key: str) -> bool:
        param = self._param(key)
        pairs = self.ours.tied or {}
        return param is not None and any(matches(name, param) for name in (*pairs, *pairs.values()))

    def report(self, expected: dict[str, tuple[int, ...] | None], separate_copies: bool) -> dict[str, Any]:
        """This rank's view: keys it would load that the checkpoint lacks or holds in another shape,
        the checkpoint keys it claims, the exclusion entries it used. `separate_copies`: this rank
        holds a tied weight's names as separate tensors (a pipeline stage keeps its own copy);
        otherwise an alias is the very tensor of the name it shares, and loads through that name."""
        missing, shapes, aliases, excluded, claimed, used = [], [], [], [], 0, set()
        for key, shape in expected.items():
            entry = excluded_by(self.exclude, key, self.top_level)
            if entry is not None:
                used.add(entry)
                excluded.append(key)
                continue
            if key in self._index:
                claimed |= 1 << self._index[key]
            if not separate_copies and self._is_alias(key):
                aliases.append(key)
                continue
            saved = self.entries.get(key)
            if saved is None:
                missing.append(key)
            elif shape is not None and (not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) != shape):
                saved_shape = list(saved.size) if isinstance(saved, TensorStorageMetadata) else "not a tensor"
                shapes.append((key, saved_shape, list(shape)))
        touched = any(self._in_tied_pair(k) for k in (*missing, *excluded, *(s[0] for s in shapes)))
        return {"missing": missing, "shapes": shapes, "aliases": aliases, "excluded": excluded, "claimed": claimed,
                "used": used, "separate": separate_copies, "tied_pair_touched": touched}

    @staticmethod
    def shareable(report: dict[str, Any]) -> dict[str, Any]:
        """What other ranks need of a report: key lists cut to a bounded length (a thousand ranks
        each sending every key of a mismatched model would be gigabytes), the rest as is."""
        return {**report, "missing": report["missing"][:_SHARED_KEYS], "shapes": report["shapes"][:_SHARED_KEYS],
                "aliases": bool(report["aliases"]), "excluded": len(report["excluded"]),
                "truncated": len(report["missing"]) > _SHARED_KEYS}

    def decide(self, reports: list[dict[str, Any]], mine: dict[str, Any]) -> LoadPlan:
        """The verdict, the same on every rank; `mine` is this rank's own report."""
        # (difference, what to do), refused unless allow_partial_load; the first one is reported.
        problems: list[tuple[str, str]] = []
        if self.saved.name and self.ours.name and self.saved.name != self.ours.name:
            problems.append((f"it holds a {self.saved.name} model, this run trains {self.ours.name}",
                             f"set model.name {self.saved.name}, or checkpoint.allow_partial_load to load it anyway"))
        heads, computed = self._conversion_differences()
        tied = self._tied_difference()
        if tied is not None:
            problems.append(tied)

        shapes = list({s[0]: s for r in reports for s in r["shapes"]}.values())  # replicas report the same keys
        if shapes and _is_adapter(shapes[0][0]):
            problems.append(self._adapter_shapes(*shapes[0], len(shapes)))
        elif shapes:
            key, saved_shape, our_shape = shapes[0]
            hint = _args_difference(self.saved.args, self.ours.args)
            more = f"; {len(shapes) - 1} more entries differ in shape" if len(shapes) > 1 else ""
            problems.append((f"{_label(key)} is {saved_shape} in the checkpoint, {our_shape} in the model"
                             + (f" ({hint})" if hint else "") + more,
                             "check model.flavor and the tokenizer (it sets the vocabulary size), or name what not "
                             "to load in checkpoint.exclude_from_loading"))
        if heads:  # as for the Hugging Face folder it came from (hf_training.check_fits): no partial load either
            first = problems[0][0] if problems else (f"its attention heads are laid out differently ({', '.join(heads)}),"
                                                     " and the query and key rows are ordered per head")
            raise self._error(first, "use the model.flavor of the converted model")
        missing = sorted({k for r in reports for k in r["missing"]})
        if missing and all(_is_adapter(k) for k in missing):
            problems.append(self._adapter_targets(f"the checkpoint has no {_examples(missing, len(missing))}"))
        elif missing and all(k.startswith("dataloader.") for k in missing):
            # A data position of another shape: another mixture of sources, or an older format.
            problems.append((f"its data position does not match this run's data: the checkpoint has no "
                             f"{_examples(missing, len(missing))} (another training.dataset_mix, or a position "
                             "saved by an older torchtitan, before data shards were byte ranges)",
                             "resume with the same data, or set checkpoint.exclude_from_loading dataloader to load "
                             "the rest and start the data over"))
        elif missing and all(k.startswith("optimizer.") for k in missing):
            # The weights fit and the optimizer state does not: another optimizer.name (AdamW's moments
            # against Muon's momentum), or another split between them (optimizer.muon_exclude).
            problems.append((f"its optimizer state is another optimizer's: the checkpoint has no "
                             f"{_examples(sorted(missing, key=lambda k: '.param_groups.' in k), len(missing))} (another "
                             "optimizer.name or optimizer.muon_exclude)",
                             "resume with the optimizer settings it was saved with, or set "
                             "checkpoint.exclude_from_loading optimizer to load the rest and start the optimizer "
                             "state over"))
        elif missing:
            count = f"{_SHARED_KEYS}+" if any(r.get("truncated") for r in reports) else len(missing)
            problems.append((f"the checkpoint has no {_examples(missing, count)}",
                             "check model.flavor and the optimizer settings, or set checkpoint.allow_partial_load to "
                             "keep their initial values"))
        claimed = 0
        for r in reports:
            claimed |= r["claimed"]
        both_tied = bool(self.saved.tied) and bool(self.ours.tied)
        extra = [k for i, k in enumerate(self.checked) if not claimed >> i & 1
                 and excluded_by(self.exclude, k, self.top_level) is None and not (both_tied and self._is_alias(k))]
        if extra and all(_is_adapter(k) for k in extra):
            problems.append(self._adapter_targets(f"the checkpoint holds {_examples(extra, len(extra))}, which this "
                                                  "model does not have"))
        elif extra:
            problems.append((f"the checkpoint holds {_examples(extra, len(extra))}, which this model does not have",
                             "check model.flavor and the optimizer settings, or set checkpoint.allow_partial_load to "
                             "leave them out"))

        if computed:
            problems.append((f"the model it was converted from computes otherwise: {', '.join(computed)}",
                             "use the model.flavor of the converted model, or set checkpoint.allow_partial_load to "
                             "compute with this run's values"))

        unused = [e for e in self.exclude if not any(e in r["used"] for r in reports)
                  and not any(excluded_by([e], k, self.top_level) for k in self.entries)]
        if unused:
            raise CheckpointError(f"checkpoint.exclude_from_loading {unused[0]!r} names nothing in {self.path} or "
                                  "in the model (give parameter names like 'output' or 'layers.7', or state names "
                                  "like 'optimizer')")
        # A pipelined run keeps a copy of a tied weight on each of two stages; loading one copy and
        # not the other would untie them for the rest of the run, so no partial load may split them.
        if any(r["separate"] for r in reports) and (tied is not None or any(r["tied_pair_touched"] for r in reports)):
            first = problems[0][0] if problems else "a tied weight would load into one pipeline stage's copy only"
            raise self._error(first, "under pipeline parallelism a tied model loads only complete, equally tied "
                                     "checkpoints; load it in a run without pipeline parallelism first")
        if problems and not self.allow_partial:
            text, advice = problems[0]
            more = f" (+{len(problems) - 1} more difference{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
            raise self._error(text + more, advice)
        return LoadPlan(self._skip(mine, problems), self._warnings(reports, [text for text, _ in problems]))

    def _skip(self, mine: dict[str, Any], problems: list[tuple[str, str]]) -> set[str]:
        skip = set(mine["excluded"]) | set(mine["aliases"])
        if problems:  # allowed by allow_partial_load: what does not fit keeps its initial value
            skip |= set(mine["missing"]) | {k for k, _, _ in mine["shapes"]}
        return skip

    def _warnings(self, reports: list[dict[str, Any]], problems: list[str]) -> list[str]:
        warnings = [f"checkpoint.allow_partial_load: {p}; loading what fits" for p in problems]
        if self.exclude:
            excluded = sorted({e for r in reports for e in r["used"]})
            warnings.append(f"not loading {', '.join(excluded)} from {self.path} (checkpoint.exclude_from_loading): "
                            "those entries keep their initial values")
        if not problems and self.saved.flavor and self.ours.flavor and self.saved.flavor != self.ours.flavor:
            hint = _args_difference(self.saved.args, self.ours.args)
            warnings.append(f"{self.path} was written by {self.saved}; loading it into {self.ours}: every entry "
                            "fits" + (f" ({hint})" if hint else ""))
        if self.ours.tied and self.saved.tied is None and any(r["aliases"] for r in reports):
            pairs = ", ".join(f"{a} to {s}" for a, s in self.ours.tied.items())
            warnings.append(f"{self.path} does not record whether its weights are tied; this model ties {pairs}, "
                            "and only the latter is loaded")
        return warnings

    def _adapter_shapes(self, key: str, saved_shape: Any, our_shape: list[int], count: int) -> tuple[str, str]:
        """A LoRA checkpoint of another rank: lora_a is (rank, in), lora_b (out, rank)."""
        rank_dim = 0 if ".lora_a." in key else 1
        saved_rank = saved_shape[rank_dim] if isinstance(saved_shape, list) else "?"
        more = f"; {count - 1} more entries differ in shape" if count > 1 else ""
        return (f"{_label(key)} is {saved_shape} in the checkpoint, {our_shape} in the model: its LoRA adapters have "
                f"rank {saved_rank}, this run's lora.rank is {our_shape[rank_dim]}{more}",
                f"set lora.rank {saved_rank} to resume them, or train new adapters from the base in another "
                "job.dump_folder")

    def _adapter_targets(self, difference: str) -> tuple[str, str]:
        """A LoRA checkpoint whose adapters sit on other layers than this run's."""
        saved = (self.saved.lora or {}).get("target_modules")
        ours = (self.ours.lora or {}).get("target_modules")
        known = f" (lora.target_modules {','.join(saved)} there, {','.join(ours)} here)" if saved and ours else ""
        return (f"its LoRA adapters sit on other layers{known}: {difference}",
                "set lora.target_modules as the checkpoint's run did, or train new adapters from the base in another "
                "job.dump_folder")

    def _conversion_differences(self) -> tuple[list[str], list[str]]:
        """Where weights made by the converter (from a Hugging Face folder, or a torch.save file of a
        named flavor) come from a model that differs from this run's in what no tensor shape shows:
        (the attention head layout, any other computation). RoPE and norm settings are left to the
        flavor-difference warning, since continued training may change them on purpose."""
        if not (self.saved.converted_from and self.saved.args and self.ours.args and self.saved.name == self.ours.name):
            return [], []
        found = differences(self.saved.args, self.ours.args, "checkpoint", "this run")
        heads = [text for name, text in found.items() if name in HEAD_FIELDS]
        computed = [text for name, text in found.items()
                    if name not in (*HEAD_FIELDS, *SHAPE_VISIBLE_FIELDS, *NUMERIC_FIELDS)]
        return heads, computed

    def _tied_difference(self) -> tuple[str, str] | None:
        """The difference when one side ties weights the other keeps apart; None when they
        agree, either side is unknown, or the tied copy is deliberately left out."""
        if self.saved.tied is None or self.ours.tied is None or bool(self.saved.tied) == bool(self.ours.tied):
            return None
        alias, source = next(iter((self.ours.tied or self.saved.tied).items()))
        if self.ours.tied:
            if all(excluded_by(self.exclude, f"model.{a}") for a in self.ours.tied):
                return None  # the untied checkpoint's own copy is left out on purpose
            return (f"{alias} is its own weight in the checkpoint, but this model ties it to {source} (checkpoint is "
                    "untied, model is tied)", f"use an untied model.flavor, or set checkpoint.exclude_from_loading "
                    f"{alias} to start from {source} alone")
        return (f"{alias} is {source} in the checkpoint, but this model keeps them apart (checkpoint is tied, model is "
                "untied)", f"use a tied model.flavor, or set checkpoint.allow_partial_load to start {alias} as a copy "
                f"of {source}")

    def _error(self, problem: str, advice: str) -> CheckpointError:
        origin = f" (written by {self.saved})" if self.saved.name else ""
        return CheckpointError(f"checkpoint {self.path}{origin} does not fit {self.ours}: {problem}; {advice}")
