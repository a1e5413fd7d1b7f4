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
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.failures import first_error, gather_from_ranks
from torchtitan.checkpoint.folders import CheckpointError, CheckpointSaveError
from torchtitan.checkpoint.states import ModelState

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 10**9  # per safetensors file, as Hugging Face's own exports
CONFIG = "config.json"
# Fields of the model args that change what the model computes but not its tensors' shapes: a
# difference is reported, not refused (continued training may change RoPE on purpose).
_NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "norm_eps", "norm_type")
# Fields that are the run's own business: the sequence length it trains on, initialisation and
# training-only settings, and the vocabulary padding (checked by the tensor shapes).
# Also fields that are only one way of writing a size (Llama's feed-forward size from multiple_of
# and ffn_dim_multiplier: config.json gives the size itself), which the tensor shapes check.
_RUN_FIELDS = ("max_seq_len", "depth_init", "moe_aux_loss_coef", "moe_bias_update_rate", "vocab_padding",
               "multiple_of", "ffn_dim_multiplier")


def is_hf_folder(path: str) -> bool:
    """A folder holding config.json and safetensors weights (one file or an index)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG)) and (
        os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, hf_folder.INDEX)))


def hf_export_path(checkpoint_folder: str, step: int) -> str:
    """Where `checkpoint.last_save_in_hf` writes step `step`: beside the DCP checkpoints, under a
    name their scan, retention and resume never take for one of theirs."""
    return os.path.join(checkpoint_folder, f"step-{step}-hf")


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

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, hf_folder._ST_DTYPES.get(self.where[name].get_slice(name).get_dtype(), "float32"))

    def read(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a truncated or damaged file fails inside safetensors
            raise CheckpointError(f"{self.path}: tensor {name} cannot be read ({e})") from None


def _parts_by_fqn(folder: _Folder, adapter: Any, args: Any) -> dict[str, list[str]]:
    """Our FQN -> the HF tensors it is made from; refuses tensors that are no parameter of the family."""
    parts = hf_folder.names_by_fqn(folder.where, args, adapter, folder.path)
    (output,), (embedding,) = adapter.from_hf_names(hf_folder.HF_OUTPUT), adapter.from_hf_names(hf_folder.HF_EMBEDDING)
    if adapter.ties_embeddings(args) and output not in parts and embedding in parts:
        parts[output] = parts[embedding]  # a tied output projection is stored only as the embedding
    return parts


def _config_differences(path: str, adapter: Any, args: Any) -> tuple[list[str], list[str]]:
    """(shape-relevant, numeric) fields in which the folder's config.json differs from the run's
    model args, each as `name X (config.json) vs Y (this run)`."""
    config = hf_folder.read_json(os.path.join(path, CONFIG), f"{path}/{CONFIG}")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}/{CONFIG} is not a JSON object")
    theirs = adapter.model_args_from_hf_config(config)
    shapes, numeric = [], []
    for f in dataclasses.fields(args):
        if not hasattr(theirs, f.name) or f.name in _RUN_FIELDS:
            continue
        a, b = getattr(theirs, f.name), getattr(args, f.name)
        if a != b:
            (numeric if f.name in _NUMERIC_FIELDS else shapes).append(f"{f.name} {a} ({CONFIG}) vs {b} (this run)")
    return shapes, numeric


def _expected_shapes(folder: _Folder, parts: dict[str, list[str]], adapter: Any, args: Any) -> dict[str, tuple]:
    """Our FQN -> the shape the folder's tensors make, converted on the meta device (no data read)."""
    shapes = {}
    for fqn, names in parts.items():
        meta = {n: torch.empty(folder.shape(n), dtype=folder.dtype(n), device="meta") for n in names}
        try:
            shapes[fqn] = tuple(adapter.from_hf_tensors(fqn, meta, args).shape)
        except CheckpointError as e:
            raise CheckpointError(f"{folder.path}: {e}") from None
    return shapes


def check_fits(path: str, adapter: Any, args: Any, whole: dict[str, tuple], exclude: list[str],
               allow_partial: bool) -> tuple[_Folder, dict[str, list[str]], list[str]]:
    """Refuses, before any tensor is read, a folder that does not fit the run's whole model
    (`whole`: FQN -> global shape). Returns the folder, its parts by FQN, and the FQNs to leave at
    their initial values (excluded, or left out of a deliberate partial load), with warnings."""
    folder = _Folder(path)
    parts = _parts_by_fqn(folder, adapter, args)
    theirs = _expected_shapes(folder, parts, adapter, args)
    shape_fields, numeric_fields = _config_differences(path, adapter, args)
    without_hf = set(adapter.tensors_without_hf(args))
    excluded = [fqn for fqn in whole if any(fqn == e or fqn.startswith(e + ".") for e in exclude)]
    problems, skip = [], list(excluded)
    for fqn, shape in whole.items():
        if fqn in excluded or fqn in without_hf:
            continue
        if fqn not in theirs:
            problems.append(f"it has no tensor for {fqn}")
        elif theirs[fqn] != shape and not _padded_rows(theirs[fqn], shape, fqn, args):
            problems.append(f"{fqn} is {list(theirs[fqn])} there, {list(shape)} in this run's model")
    extra = sorted(set(theirs) - set(whole))
    if extra:
        problems.append(f"it holds {extra[0]}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                        + " that this run's model does not have")
    if problems and not allow_partial:
        why = f" (its {CONFIG} differs: {', '.join(shape_fields)})" if shape_fields else ""
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not fit this run's model{why}: "
                              f"{problems[0]}" + (f"; and {len(problems) - 1} more problems" if len(problems) > 1 else "")
                              + "; use a folder of this model, or set checkpoint.allow_partial_load")
    warnings = [f"{path}: {p}; left as initialised (checkpoint.allow_partial_load)" for p in problems]
    skip += [fqn for fqn, shape in whole.items() if fqn not in excluded and fqn not in without_hf and (
        fqn not in theirs or (theirs[fqn] != shape and not _padded_rows(theirs[fqn], shape, fqn, args)))]
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


def _padded_rows(theirs: tuple, ours: tuple, fqn: str, args: Any) -> bool:
    """Whether our tensor is theirs plus the padding rows of a padded vocabulary."""
    padding = getattr(args, "vocab_padding", 0)
    return bool(padding) and len(theirs) == len(ours) and theirs[0] + padding == ours[0] and theirs[1:] == ours[1:]


def load_hf_weights(path: str, model: ModelState, adapter: Any, args: Any, whole: dict[str, tuple],
                    exclude: list[str], allow_partial: bool) -> int:
    """Loads the folder's weights into the model's parameters (each rank its own shards); returns
    the number of bytes read."""
    folder, parts, skip = check_fits(path, adapter, args, whole, exclude, allow_partial)
    state = model.state_dict()
    loaded, read = {}, 0
    for fqn, current in state.items():
        if fqn not in parts or fqn in skip:
            continue
        group = {n: folder.read(n) for n in parts[fqn]}
        read += sum(t.numel() * t.element_size() for t in group.values())
        full = adapter.from_hf_tensors(fqn, group, args)
        del group
        shape = tuple(current.shape)
        if tuple(full.shape) != shape:  # a padded vocabulary: padding rows are masked, never used
            full = torch.cat([full, full.new_zeros((shape[0] - full.shape[0], *shape[1:]))])
        local = current.to_local() if isinstance(current, DTensor) else current
        full = full.to(device=local.device, dtype=local.dtype)
        if isinstance(current, DTensor):
            loaded[fqn] = distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=None)
        else:
            loaded[fqn] = full
        del full
    model.load_state_dict(loaded)
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
                     config_extra: dict[str, Any], tokenizer_file: str | None, attempt: str) -> str:
    """Writes the model as a Hugging Face folder at `out` (collective: every rank calls it).
    Returns a summary for the log; raises CheckpointSaveError (on every rank) when it cannot."""
    start = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = f"{out}.partial-{attempt}"
    leader = _leader_of_stage(parallel_dims)
    error = None
    if rank == 0:
        try:
            parent = os.path.dirname(out)
            os.makedirs(parent, exist_ok=True)
            for name in os.listdir(parent):  # an earlier job's export that never finished
                if name.startswith(os.path.basename(out) + ".partial-"):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = str(e)
    error = first_error(error)
    if error is not None:
        raise CheckpointSaveError(f"final weights not written as a Hugging Face folder: {error}")
    tied = adapter.ties_embeddings(args)
    state = model.state_dict()
    stage = parallel_dims.pp_mesh.get_local_rank() if getattr(parallel_dims, "pp_enabled", False) else 0
    written: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes) of this writer
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        name = f"stage{stage}-{len(written):05d}.safetensors"
        hf_folder.import_safetensors().torch.save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
        written.append((name, sorted(shard), size))
        shard, size = {}, 0

    try:
        for fqn in sorted(state, key=lambda k: hf_folder._hf_order(adapter.to_hf_name(k) or k)):
            value = state[fqn]
            full = value.full_tensor() if isinstance(value, DTensor) else value  # every rank of its mesh joins
            if not leader:
                continue
            if tied and adapter.from_hf_names(hf_folder.HF_OUTPUT) == (fqn,):
                continue  # stored once, as the embedding
            padding = getattr(args, "vocab_padding", 0)
            if padding and fqn in (adapter.from_hf_names(hf_folder.HF_OUTPUT) + adapter.from_hf_names(hf_folder.HF_EMBEDDING)):
                full = full[: full.shape[0] - padding]  # HF has no padding rows
            for name, tensor in adapter.to_hf_tensors(fqn, full.detach().to("cpu", dtype), args).items():
                tensor = tensor.contiguous().clone()  # apart from every other tensor (safetensors refuses shared storage)
                nbytes = tensor.numel() * tensor.element_size()
                if shard and size + nbytes > MAX_SHARD_BYTES:
                    flush()
                shard[name] = tensor
                size += nbytes
        if leader:
            flush()
    except OSError as e:
        error = f"{type(e).__name__}: {e}"
    error = first_error(error)
    files = gather_from_ranks(written if leader else [])
    if error is None and rank == 0:
        try:
            _finish(tmp, out, [f for per_rank in files for f in per_rank], adapter, args, dtype, config_extra,
                    tokenizer_file)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    error = first_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"final weights not written as a Hugging Face folder: {error}")
    total = sum(b for per_rank in files for _, _, b in per_rank)
    return f"wrote the final weights as a Hugging Face folder {out} ({total / 2**20:.1f} MiB) in " \
           f"{time.perf_counter() - start:.2f}s"


def _finish(tmp: str, out: str, files: list[tuple[str, list[str], int]], adapter: Any, args: Any, dtype: torch.dtype,
            config_extra: dict[str, Any], tokenizer_file: str | None) -> None:
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
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, os.path.join(tmp, hf_folder.TOKENIZER_FILE))
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
