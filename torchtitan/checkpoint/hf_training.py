"""Hugging Face folders in a training run: weights read straight into any layout, and the final weights written as one.

Reading (`checkpoint.initial_load_path` naming a folder with config.json and safetensors): before
any tensor is read, the folder's tensor names and shapes (from the safetensors headers, converted
on the meta device by the family's HFAdapter) are checked against the run's model, so a folder of
another size is refused in one line naming what differs. Then each rank goes through the
parameters it holds, one at a time: it reads the HF tensors that make up that parameter (safetensors
maps the files, so only those bytes are read), converts them to our layout, keeps its own shard
(`distribute_tensor` with `src_data_rank=None` slices locally, without communication, for any
placement: FSDP, TP, both, EP) and drops the rest. No rank ever holds more than one whole parameter
besides its shards.

Writing (`checkpoint.last_save_in_hf`): after the last step, each parameter is gathered whole
(`full_tensor()`, a collective over the ranks that share it), converted to HF names and layout and
handed to one writer per pipeline stage, which fills safetensors shards of at most
MAX_SHARD_BYTES; rank 0 then names the files, writes the index, config.json and the tokenizer,
and publishes the folder under its final name (`<checkpoint folder>/step-N-hf`) once complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.failures import NotEnoughSpace, first_error, free_bytes, gather_from_ranks, save_failure
from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError
from torchtitan.checkpoint.model_args import HEAD_FIELDS, NUMERIC_FIELDS, RUN_FIELDS, SHAPE_VISIBLE_FIELDS
from torchtitan.checkpoint.states import ModelState

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 10**9  # per safetensors file, as Hugging Face's own exports
OPTION = "checkpoint.initial_load_path"  # what names the folder being read, in the lines of a training run
CONFIG = "config.json"


def is_hf_folder(path: str) -> bool:
    """A folder holding config.json and safetensors weights (one file or an index)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG)) and (
        os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, hf_folder.INDEX)))


# An export being written, or one killed before it was published (or while replacing an older one).
_UNFINISHED = re.compile(r"^(step-\d+-hf)\.(partial|replaced)-")
# Safetensors dtypes a folder's weights may have: floating point, which converts to any training
# dtype without loss of meaning (float8 or integer weights are quantized and need their scales).
_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")
# Quantized parts a family's conversion may dequantize (DeepSeek-V3's fp8 weights beside their
# scales, gpt-oss's MXFP4 blocks and scales): read, and refused unless what they convert to is one
# of the weight dtypes above.
_QUANTIZED_DTYPES = ("U8", "F8_E4M3", "F8_E5M2")
_TORCH_WEIGHT_DTYPES = tuple(hf_folder._ST_DTYPES[d] for d in _WEIGHT_DTYPES)


def hf_export_path(checkpoint_folder: str, step: int) -> str:
    """Where `checkpoint.last_save_in_hf` writes step `step`: beside the DCP checkpoints, under a
    name their scan, retention and resume never take for one of theirs."""
    return os.path.join(checkpoint_folder, f"step-{step}-hf")


def check_export_target(job_config: Any) -> None:
    """Refuses an export that would replace the folder the run starts from (a job started from its
    own earlier export of the same step), before anything is trained."""
    checkpoint = job_config.checkpoint
    if not (checkpoint.last_save_in_hf and checkpoint.initial_load_path):
        return
    target = hf_export_path(os.path.join(job_config.job.dump_folder, checkpoint.folder), job_config.training.steps)
    if os.path.realpath(target) == os.path.realpath(checkpoint.initial_load_path):
        raise CheckpointError(f"checkpoint.last_save_in_hf would write the final weights over {target}, the folder "
                              "this run starts from (checkpoint.initial_load_path); use another job.dump_folder, or "
                              "copy the folder elsewhere first")


# ---------------------------------------------------------------------------------------------
# Reading


class _Folder:
    """The folder's tensors by HF name, opened lazily (safetensors maps the files)."""

    def __init__(self, path: str):
        self.path = path
        safetensors = hf_folder.import_safetensors()
        self.files = hf_folder.safetensors_files(path)
        self.where: dict[str, Any] = {}
        self._handles = []
        for name in self.files:
            file = os.path.join(path, name)
            try:
                handle = safetensors.safe_open(file, framework="pt")
            except (safetensors.SafetensorError, OSError) as e:
                raise CheckpointError(f"{file} is not a valid safetensors file ({e})") from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in self.where:
                    raise CheckpointError(f"{path}: tensor {key} is stored twice")
                self.where[key] = handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> str:
        return self.where[name].get_slice(name).get_dtype()

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype; one line for one that weights cannot be converted from."""
        stored = self.stored_dtype(name)
        if stored not in _WEIGHT_DTYPES + _QUANTIZED_DTYPES:
            raise self.not_weights(name)
        return getattr(torch, hf_folder._ST_DTYPES[stored])

    def not_weights(self, name: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: tensor {name} is stored as {self.stored_dtype(name)}; weights are read "
                               f"from {', '.join(_WEIGHT_DTYPES)} only (dequantize the folder first)")

    def read(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a truncated or damaged file fails inside safetensors
            raise CheckpointError(f"{self.path}: tensor {name} cannot be read ({e})") from None


def _tie(parts: dict[str, list[str]], excluded: list[str], adapter: Any, args: Any,
         untied_folder: bool) -> tuple[list[str], str | None]:
    """For a tied model: the output projection is read from the embedding, and excluded with it,
    so both names (under pipeline parallelism, both stages' copies) always load alike. Returns the
    exclusions so adjusted, and the problem of an untied folder's own output projection (a tied
    folder's redundant copy, which some exports keep, is ignored)."""
    (output,), (embedding,) = adapter.from_hf_names(hf_folder.HF_OUTPUT), adapter.from_hf_names(hf_folder.HF_EMBEDDING)
    if not adapter.ties_embeddings(args):
        return excluded, None
    problem = None
    if untied_folder and output in parts and parts[output] != parts.get(embedding) and output not in excluded:
        problem = f"{output} is a tensor of its own there ({parts[output][0]}), but this run's model ties it to {embedding}"
    if embedding in parts:
        parts[output] = parts[embedding]
    else:
        parts.pop(output, None)
    if output in excluded and embedding not in excluded:
        logger.info(f"checkpoint.exclude_from_loading {output}: this run's model ties it to {embedding}, so the "
                    f"folder's own {output} (if any) is not read and the embedding is loaded for both")
    return [f for f in excluded if f != output] + ([output] if embedding in excluded else []), problem


def _config_differences(path: str, adapter: Any, args: Any, option: str) -> tuple[dict[str, str], list[str], Any]:
    """(shape-relevant, numeric) fields in which the folder's config.json differs from the run's
    model args, each as `name X (config.json) vs Y (this run)`; the first by field name; and the
    model args config.json describes."""
    config = hf_folder.read_json(os.path.join(path, CONFIG), f"{path}/{CONFIG}")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}/{CONFIG} is not a JSON object")
    try:
        theirs = adapter.model_args_from_hf_config(config)
    except CheckpointError as e:  # the adapter names the field; the folder is said here
        raise CheckpointError(f"{option} {path}: {CONFIG}: {e}") from None
    shapes, numeric = {}, []
    for f in dataclasses.fields(args):
        if not hasattr(theirs, f.name) or f.name in RUN_FIELDS:
            continue
        a, b = getattr(theirs, f.name), getattr(args, f.name)
        if f.name == "n_kv_heads":  # None means one key/value head per attention head
            a, b = a or theirs.n_heads, b or args.n_heads
        if a == b:
            continue
        text = f"{f.name} {a} ({CONFIG}) vs {b} (this run)"
        if f.name in NUMERIC_FIELDS:
            numeric.append(text)
        else:
            shapes[f.name] = text
    return shapes, numeric, theirs


def _expected_shapes(folder: _Folder, parts: dict[str, list[str]], adapter: Any, args: Any) -> dict[str, tuple]:
    """Our FQN -> the shape the folder's tensors make, converted on the meta device (no data read)."""
    shapes = {}
    for fqn, names in parts.items():
        meta = {n: torch.empty(folder.shape(n), dtype=folder.dtype(n), device="meta") for n in names}
        try:
            converted = adapter.from_hf_tensors(fqn, meta, args)
        except CheckpointError as e:
            raise CheckpointError(f"{folder.path}: {e}") from None
        if str(converted.dtype).removeprefix("torch.") not in _TORCH_WEIGHT_DTYPES:
            # quantized parts the family does not dequantize (an fp8 weight in a Llama folder, say)
            raise folder.not_weights(next(n for n in names if folder.stored_dtype(n) not in _WEIGHT_DTYPES))
        shapes[fqn] = tuple(converted.shape)
    return shapes


def check_fits(path: str, adapter: Any, args: Any, whole: dict[str, tuple], exclude: list[str],
               allow_partial: bool, option: str = OPTION) -> tuple[_Folder, dict[str, list[str]], list[str]]:
    """Refuses, before any tensor is read, a folder that does not fit the run's whole model
    (`whole`: FQN -> global shape). Returns the folder, its parts by FQN, and the FQNs to leave at
    their initial values (excluded, or left out of a deliberate partial load), with warnings.
    `option` names the folder in the lines (a tool reading one for itself has no partial loads)."""
    # config.json first: a folder of another family is best named by its model_type.
    shape_fields, numeric_fields, theirs_args = _config_differences(path, adapter, args, option)
    if any(name in HEAD_FIELDS for name in shape_fields):
        # Equal shapes can hide this (dim 256 as 16 heads of 16 or 8 of 32), and the query and key
        # rows are ordered per head for RoPE, so no partial load can use such weights.
        raise CheckpointError(f"{option} {path} does not fit this run's model (its {CONFIG} "
                              f"differs: {', '.join(shape_fields.values())}): its attention heads are laid out "
                              "differently, and the query and key rows are ordered per head; use a folder of this model")
    folder = _Folder(path)
    parts = hf_folder.names_by_fqn(folder.where, args, adapter, path)
    excluded = [fqn for fqn in whole if any(fqn == e or fqn.startswith(e + ".") for e in exclude)]
    excluded, tie_problem = _tie(parts, excluded, adapter, args, "tie_word_embeddings" in shape_fields)
    theirs = _expected_shapes(folder, parts, adapter, args)
    without_hf = set(adapter.tensors_without_hf(args))
    # Fields no tensor shape shows (a MoE's experts per token): the run would compute another model.
    computed = [f"{CONFIG} has {text}" for name, text in shape_fields.items() if name not in SHAPE_VISIBLE_FIELDS]
    missing, skip = [], list(excluded)
    for fqn, shape in whole.items():
        if fqn in excluded or fqn in without_hf:
            continue
        if fqn not in theirs:
            missing.append(f"it has no tensor for {fqn}")
            skip.append(fqn)
        elif theirs[fqn] != _unpadded(shape, fqn, adapter, args):
            padding = _unpadded(shape, fqn, adapter, args) != shape
            missing.append(f"{fqn} is {list(theirs[fqn])} there, {list(_unpadded(shape, fqn, adapter, args))} in this "
                           f"run's model" + (f" (plus {args.vocab_padding} padding rows)" if padding else ""))
            skip.append(fqn)
    extra = sorted(set(theirs) - set(whole))
    if extra:
        missing.append(f"it holds {extra[0]}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                       + " that this run's model does not have")
    # What the folder's own config.json promises and its weights lack, in the family's words, first.
    promised = hf_folder.promised_but_missing(adapter, theirs_args, parts)
    problems = ([promised] if promised else []) + computed + ([tie_problem] if tie_problem else []) + missing
    if promised and not allow_partial:
        # The tensors it lacks are the promise's; its fix (edit config.json) is the one to give.
        raise CheckpointError(f"{option} {path}: {promised}")
    if problems and not allow_partial:
        why = f" (its {CONFIG} differs: {', '.join(shape_fields.values())})" if shape_fields else ""
        output = adapter.from_hf_names(hf_folder.HF_OUTPUT)[0].removesuffix(".weight")
        fix = (f"use an untied model.flavor, or set checkpoint.exclude_from_loading {output} to load the embedding alone"
               if problems[0] == tie_problem else "use a folder of this model, or set checkpoint.allow_partial_load")
        if option != OPTION:
            fix = "use a folder of this model"
        raise CheckpointError(f"{option} {path} does not fit this run's model{why}: "
                              f"{problems[0]}" + (f"; and {len(problems) - 1} more problems" if len(problems) > 1 else "")
                              + f"; {fix}")
    warnings = [f"{path}: {promised}"] if promised else []
    warnings += [f"{path}: {p}; the run computes with its own value (checkpoint.allow_partial_load)" for p in computed]
    if tie_problem:
        warnings.append(f"{path}: {tie_problem}; the embedding is loaded for both (checkpoint.allow_partial_load)")
    warnings += [f"{path}: {p}; left as initialised (checkpoint.allow_partial_load)" for p in missing]
    if numeric_fields:
        warnings.append(f"{path}/{CONFIG} differs from this run's model in {', '.join(numeric_fields)}; the run "
                        "computes with its own values")
    if excluded:
        warnings.append(f"not loading {len(excluded)} tensors from {path} (checkpoint.exclude_from_loading): they "
                        "keep their initial values")
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        for w in warnings:
            logger.warning(w)
    return folder, parts, skip


def _unpadded(shape: tuple, fqn: str, adapter: Any, args: Any) -> tuple:
    """The shape a folder's tensor must have to become our `fqn` of `shape`: the embedding and the
    output projection without the padding rows of a padded vocabulary (an HF folder has none, so a
    folder whose rows fill the padding is of another vocabulary, not ours padded)."""
    padding = getattr(args, "vocab_padding", 0)
    vocab = adapter.from_hf_names(hf_folder.HF_EMBEDDING) + adapter.from_hf_names(hf_folder.HF_OUTPUT)
    return (shape[0] - padding, *shape[1:]) if padding and fqn in vocab else shape


def load_hf_weights(path: str, model: ModelState, adapter: Any, args: Any, whole: dict[str, tuple],
                    exclude: list[str], allow_partial: bool, option: str = OPTION) -> int:
    """Loads the folder's weights into the model's parameters (each rank its own shards); returns
    the number of bytes read. Collective: a rank that cannot read stops every rank with its line."""
    read, error = 0, None
    try:
        folder, parts, skip = check_fits(path, adapter, args, whole, exclude, allow_partial, option)
        # The state dict's tensors share storage with the parameters (DTensors: their local
        # shards), so each is filled in place as soon as it is converted: besides the model, a rank
        # holds one whole parameter and one shard of it at a time.
        for fqn, current in model.state_dict().items():
            if fqn in parts and fqn not in skip:
                read += _load_one(folder, parts[fqn], fqn, current, adapter, args)
    except CheckpointError as e:
        error = str(e)
    error = first_error(error)  # every rank stops, not only the one (the pipeline stage) that hit it
    if error is not None:
        raise CheckpointError(error)
    return read


@torch.no_grad()
def _load_one(folder: _Folder, names: list[str], fqn: str, current: torch.Tensor, adapter: Any, args: Any) -> int:
    """Reads, converts and copies in one of our tensors; returns the bytes read."""
    group = {n: folder.read(n) for n in names}
    read = sum(t.numel() * t.element_size() for t in group.values())
    full = adapter.from_hf_tensors(fqn, group, args)
    del group
    shape = tuple(current.shape)
    if tuple(full.shape) != shape:  # a padded vocabulary: padding rows are masked, never used
        full = torch.cat([full, full.new_zeros((shape[0] - full.shape[0], *shape[1:]))])
    if isinstance(current, DTensor):
        # Local slicing, no communication (src_data_rank=None): right for Shard, _StridedShard
        # (FSDP over TP) and Replicate alike.
        shard = distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=None)
        current.to_local().copy_(shard.to_local())
    else:
        current.copy_(full)
    return read


# ---------------------------------------------------------------------------------------------
# Writing


def _leader_of_stage(parallel_dims: Any) -> bool:
    """Whether this rank writes its pipeline stage's tensors: rank 0 of the ranks holding the stage."""
    mesh = parallel_dims.world_mesh
    if mesh is None or not dist.is_initialized():
        return True
    coords = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names or ()
    return all(c == 0 for name, c in zip(names, coords) if name != "pp")


def write_hf_weights(model: ModelState, adapter: Any, args: Any, parallel_dims: Any, out: str, dtype: torch.dtype,
                     config_extra: dict[str, Any], tokenizer: dict[str, bytes] | None, attempt: str) -> str:
    """Writes the model as a Hugging Face folder at `out` (collective: every rank calls it).
    Returns a summary for the log; raises CheckpointSaveError (on every rank) when it cannot."""
    start = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = f"{out}.partial-{attempt}"
    leader = _leader_of_stage(parallel_dims)
    parent = os.path.dirname(out)
    tied = adapter.ties_embeddings(args)
    state = model.state_dict()
    # What the writers will write, known from the global shapes before anything is gathered.
    needed = sum(gather_from_ranks(_export_bytes(state, adapter, dtype, tied) if leader else 0))
    error = first_error(_prepare(out, tmp, needed) if rank == 0 else None)
    if error is not None:
        raise CheckpointSaveError(f"final weights not written as a Hugging Face folder: {error}")
    stage = parallel_dims.pp_mesh.get_local_rank() if getattr(parallel_dims, "pp_enabled", False) else 0
    written: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes) of this writer
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        name = f"stage{stage:05d}-{len(written):05d}.safetensors"  # sorts in stage order
        hf_folder.import_safetensors().torch.save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
        written.append((name, sorted(shard), size))
        shard, size = {}, 0

    error = None
    padding = getattr(args, "vocab_padding", 0)
    # Tensors HF's format has no place for (a MoE's aux-loss-free routing biases): said when they
    # are not at their initial zeros, since the export then computes otherwise in transformers.
    without_hf, dropped = set(adapter.tensors_without_hf(args)), []
    embedding_names = adapter.from_hf_names(hf_folder.HF_OUTPUT) + adapter.from_hf_names(hf_folder.HF_EMBEDDING)
    # Parts of an HF tensor made of several of ours (gpt-oss's gate_up_proj from w1 and w3), held
    # until the last arrives: they share that HF name, so the sort below brings them together.
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for fqn in sorted(state, key=lambda k: hf_folder._hf_order(adapter.to_hf_name(k) or k)):
        value = state[fqn]
        full = value.full_tensor() if isinstance(value, DTensor) else value  # every rank of its mesh joins
        # A writer that failed still joins every gather, so that no rank waits for it forever.
        if not leader or error is not None or (tied and adapter.from_hf_names(hf_folder.HF_OUTPUT) == (fqn,)):
            continue  # a tied output projection is stored once, as the embedding
        if padding and fqn in embedding_names:
            full = full[: full.shape[0] - padding]  # HF has no padding rows
        if fqn in without_hf and bool(full.any()):
            dropped.append(fqn)
        try:
            for name, tensor in hf_folder.hf_tensors_of(adapter, fqn, full.detach().to("cpu", dtype), args,
                                                        pending).items():
                tensor = tensor.contiguous().clone()  # apart from every other tensor (safetensors refuses shared storage)
                nbytes = tensor.numel() * tensor.element_size()
                if shard and size + nbytes > MAX_SHARD_BYTES:
                    flush()
                shard[name] = tensor
                size += nbytes
        except Exception as e:  # noqa: BLE001 - safetensors reports a full disk as SafetensorError, not OSError
            error = save_failure(e, parent)
    if leader and error is None:
        try:
            flush()
        except Exception as e:  # noqa: BLE001 - as above
            error = save_failure(e, parent)
    if dropped:
        logger.warning(f"the Hugging Face export leaves out {len(dropped)} tensors its format has no place for, "
                       f"{dropped[0]}{' and more' if len(dropped) > 1 else ''}; they are not zero, so the exported "
                       "model computes otherwise in transformers (this project's loader, initial_load_path or "
                       "scripts/generate.py, reads them back as zeros too)")
    error = first_error(error)
    files = gather_from_ranks(written if leader else [])
    if error is None and rank == 0:
        try:
            _finish(tmp, out, [f for per_rank in files for f in per_rank], adapter, args, dtype, config_extra,
                    tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank, or they wait forever
            error = save_failure(e, parent)
    error = first_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"final weights not written as a Hugging Face folder: {error}")
    total = sum(b for per_rank in files for _, _, b in per_rank)
    return f"wrote the final weights as a Hugging Face folder {out} ({total / 2**20:.1f} MiB) in " \
           f"{time.perf_counter() - start:.2f}s"


def _prepare(out: str, tmp: str, needed: int) -> str | None:
    """Rank 0, before anything is gathered: removes unfinished exports, checks the free space and
    creates the temporary folder. Returns the error line, if any."""
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        for name in sorted(os.listdir(parent)):  # an earlier job's export that never finished, of any step
            unfinished = _UNFINISHED.match(name)
            if unfinished is None:
                continue
            final = os.path.join(parent, unfinished.group(1))
            if unfinished.group(2) == "replaced" and not os.path.exists(final):
                # A complete older export moved aside, its replacement killed before taking its name.
                os.rename(os.path.join(parent, name), final)
                logger.warning(f"restored {final}: an export that replaced it never finished")
            else:
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        free = free_bytes(parent)
        if free is not None and needed * 1.01 > free:  # refused before a byte is written
            raise NotEnoughSpace(out, int(needed * 1.01), free)
        os.makedirs(tmp)
    except OSError as e:
        return save_failure(e, parent)
    return None


def _export_bytes(state: dict[str, Any], adapter: Any, dtype: torch.dtype, tied: bool) -> int:
    """Bytes this pipeline stage's writer will write (global shapes; a tied output is stored once)."""
    output = adapter.from_hf_names(hf_folder.HF_OUTPUT)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(v.numel() * itemsize for k, v in state.items()
               if not (tied and (k,) == output) and adapter.to_hf_name(k) is not None)


def _finish(tmp: str, out: str, files: list[tuple[str, list[str], int]], adapter: Any, args: Any, dtype: torch.dtype,
            config_extra: dict[str, Any], tokenizer: dict[str, bytes] | None) -> None:
    """Rank 0: gives the shard files their final names, writes the index (several files),
    config.json and the tokenizer, then publishes `tmp` as `out`."""
    files = sorted(files)  # stage order, then each writer's order
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    for (old, _, _), new in zip(files, names):
        os.rename(os.path.join(tmp, old), os.path.join(tmp, new))
    if len(files) > 1:
        weight_map = {t: new for (_, tensors, _), new in zip(files, names) for t in tensors}
        index = {"metadata": {"total_size": sum(b for _, _, b in files)}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp, hf_folder.INDEX), "w") as f:
            json.dump(index, f, indent=2)
    config = adapter.hf_config(args, torch_dtype=str(dtype).removeprefix("torch."), **config_extra)
    if getattr(args, "vocab_padding", 0):
        config["vocab_size"] = args.vocab_size
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for name, contents in (tokenizer or {}).items():  # the files as the run read them at start-up
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(contents)
    hf_folder.give_default_modes(tmp)
    if os.path.exists(out):  # an earlier run's export of the same step: replaced once the new one is complete
        old = f"{out}.replaced-{time.time_ns()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        logger.warning(f"replaced {out}, an earlier run's export of the same step")
    else:
        os.rename(tmp, out)


def whole_model_shapes(model: nn.Module) -> dict[str, tuple]:
    """FQN -> shape of every parameter and persistent buffer of a whole model built on the meta device."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
