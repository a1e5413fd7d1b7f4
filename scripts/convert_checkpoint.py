#!/usr/bin/env python
"""Converts Llama weights between this project's DCP checkpoints, Hugging Face safetensors folders and torch.save files.

Usage examples (from the repository root, with PYTHONPATH=.):

  # A Hugging Face Llama folder -> a weights-only checkpoint that starts a run
  python scripts/convert_checkpoint.py hf-to-dcp ~/models/Llama-3.1-8B ckpt/llama3_8b
  python -m torchtitan.train --job.config_file train_configs/llama3_8b.toml --checkpoint.initial_load_path ckpt/llama3_8b

  # Any checkpoint of ours (full or weights-only) -> a Hugging Face folder. A folder made by hf-to-dcp
  # comes back byte-identical to the original; others get a fresh config.json and safetensors shards.
  python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out --dtype bfloat16 --max-shard-size-mb 4096

  # One torch.save file of the model state dict (our parameter names), and back
  python scripts/convert_checkpoint.py dcp-to-torch outputs/checkpoint/step-1000 model.pt --dtype bfloat16
  python scripts/convert_checkpoint.py torch-to-dcp model.pt ckpt/from_torch --flavor debugmodel

Inputs are only ever read with safe loaders: safetensors, DCP through a restricted unpickler, and
torch.load(weights_only=True). A user mistake prints one `error: ...` line on stderr, exits with
status 2 and leaves nothing behind; outputs appear under their final name only once complete.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import struct
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable, Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.checkpoint import folders
from torchtitan.checkpoint.folders import Manifest
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from torchtitan.models import get_train_spec, registered_names
from torchtitan.models.llama import hf_format
from torchtitan.models.llama.model import ModelArgs, Transformer

# safetensors is optional (the `convert` extra): imported by the commands that need it.

SIDECAR = "hf"  # subfolder of a checkpoint made by hf-to-dcp: what reproduces the original files
SIDECAR_FORMAT = "torchtitan-hf-sidecar-1"
_INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_DTYPES = ("float32", "bfloat16", "float16")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# Derived buffers some HF exports carry: kept in the sidecar, so the files still come back exactly.
_BUFFER_SUFFIX = ".rotary_emb.inv_freq"


class UserError(Exception):
    """A mistake in the command's input; reported as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Checks on paths


def _require_dir(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise UserError(f"{what} {path} does not exist")
    if not os.path.isdir(path):
        raise UserError(f"{what} {path} is not a folder")


def _require_new_output(path: str) -> None:
    if os.path.isdir(path) and not os.listdir(path):
        return  # an empty folder is replaced
    if os.path.exists(path):
        raise UserError(f"output {path} already exists; remove it or choose another name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"the folder {parent} for output {path} does not exist")


def _require_checkpoint(path: str) -> Manifest:
    problem = folders.problem_with(path)
    if problem is not None:
        raise UserError(f"checkpoint {path} {problem}")
    return Manifest.read(path)


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise UserError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{what} {path} is not valid JSON ({e})") from None


def _import_safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise UserError("the safetensors package is not installed; run `pip install safetensors` "
                        "(or install torchtitan with the `convert` extra)") from None
    return safetensors


def _temporary_sibling(path: str) -> str:
    path = os.path.abspath(path)
    return f"{path}.partial-{os.getpid()}-{time.time_ns()}"


def _move_into_place(tmp: str, final: str) -> None:
    if os.path.isdir(final):  # checked empty by _require_new_output
        os.rmdir(final)
    os.rename(tmp, final)


# ---------------------------------------------------------------------------------------------
# Model names, shapes and arguments


def _check_names(names: list[str], where: str) -> None:
    """Refuses names that are not Llama parameters and sets of names that are not a whole model."""
    unknown = sorted(n for n in names if not hf_format.is_llama_name(n))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise UserError(f"{where} holds tensors that are not Llama parameters: {unknown[0]}{more}")
    missing = sorted(set(hf_format.param_names(_n_layers(names))) - set(names))
    if missing:
        raise UserError(f"{where} is not a whole Llama model: it lacks {missing[0]}" +
                        (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def _n_layers(names: list[str]) -> int:
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    return max(layers) + 1 if layers else 0


def _args_with_shapes(base: ModelArgs, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                      n_kv_heads: int | None) -> ModelArgs:
    """`base` ModelArgs with every size the tensors tell: dim, vocabulary, layers, feed-forward
    and (given the head count, which shapes cannot tell) the key/value head count."""
    rows, dim = shapes["tok_embeddings.weight"]
    if n_heads is None and dim != base.dim:
        raise UserError(f"the weights have dim {dim}, not the {base.dim} of the flavor they claim, so their head count is "
                        "unknown; pass --n-heads (and --n-kv-heads)")
    n_heads = n_heads or base.n_heads
    if dim % n_heads:
        raise UserError(f"dim {dim} is not divisible by {n_heads} heads; pass --n-heads")
    kv_from_shape = shapes["layers.0.attention.wk.weight"][0] // (dim // n_heads)
    if n_kv_heads is not None and n_kv_heads != kv_from_shape:
        raise UserError(f"--n-kv-heads {n_kv_heads} does not fit the key projection's {kv_from_shape} heads of "
                        f"{dim // n_heads} dims")
    # Every embedding row becomes part of HF's vocabulary: HF has no masked padding rows.
    args = dataclasses.replace(base, dim=dim, n_heads=n_heads, n_kv_heads=None if kv_from_shape == n_heads else kv_from_shape,
                               vocab_size=rows, vocab_padding=0, n_layers=_n_layers(list(shapes)))
    return hf_format.with_ffn_hidden_dim(args, shapes["layers.0.feed_forward.w1.weight"][0])


def _registry_args(manifest: Manifest, n_heads: int | None) -> ModelArgs:
    """The ModelArgs of the flavor that wrote the checkpoint (or defaults when --n-heads is given)."""
    name, flavor = manifest.model.get("name"), manifest.model.get("flavor")
    try:
        return get_train_spec(name).config[flavor]
    except (KeyError, ValueError):
        if n_heads is None:
            raise UserError(f"the checkpoint's model {name} {flavor} is not a registered flavor, so its head count is "
                            "unknown; pass --n-heads (and --n-kv-heads)") from None
        return ModelArgs()


def _check_shapes(tensors: dict[str, torch.Tensor], args: ModelArgs, where: str) -> None:
    """Refuses tensors whose shapes differ from those of the model `args` describe."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if extra or missing:
        raise UserError(f"{where} holds {extra[0]}, which config.json does not imply" if extra
                        else f"{where} lacks {missing[0]}, which config.json implies")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise UserError(f"{where}: {name} has shape {list(tensor.shape)}, but config.json implies {list(expected[name])}")


# ---------------------------------------------------------------------------------------------
# Reading and writing DCP checkpoints


@contextlib.contextmanager
def _single_process():
    """DCP warns on every single-process save or load, which is how this tool always works."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _load_model_entries(ckpt: str, dtype: str | None) -> dict[str, torch.Tensor]:
    """Our FQN -> tensor for every `model.*` entry of the checkpoint (other states are skipped)."""
    try:
        metadata = read_metadata(ckpt)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise UserError(f"checkpoint {ckpt}: its DCP metadata cannot be read safely ({e})") from None
    entries = {k: v for k, v in metadata.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not entries:
        raise UserError(f"checkpoint {ckpt} holds no model weights")
    _check_names([k.removeprefix("model.") for k in entries], f"checkpoint {ckpt}")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    with _single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    cast = getattr(torch, dtype) if dtype else None
    return {k.removeprefix("model."): v.to(cast) if cast is not None and v.is_floating_point() else v
            for k, v in state.items()}


def _common_dtype(tensors: Iterable[torch.Tensor]) -> str:
    counts = Counter(str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else "float32"


def _write_dcp(model: dict[str, torch.Tensor], out: str, manifest: Manifest,
               extra: Callable[[str], None] | None = None) -> None:
    """Writes `model` (our FQN -> tensor) as a weights-only checkpoint at `out`: into a temporary
    sibling first, then published (manifest last, then renamed), so `out` is never half-written."""
    tmp = _temporary_sibling(out)
    try:
        with _single_process():
            dcp.save({"model": model}, checkpoint_id=tmp, no_dist=True)
        if extra is not None:
            extra(tmp)
        if os.path.isdir(out):  # checked empty by _require_new_output
            os.rmdir(out)
        folders.publish(tmp, os.path.abspath(out), manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _weights_manifest(model: dict[str, torch.Tensor], name: str, flavor: str) -> Manifest:
    return Manifest(step=0, contents=["model"], model={"name": name, "flavor": flavor},
                    dtype=_common_dtype(model.values()))


# ---------------------------------------------------------------------------------------------
# Reading Hugging Face folders


def _safetensors_files(hf_dir: str) -> list[str]:
    """The weight files of an HF folder: those its index names, else the single model.safetensors."""
    index_path = os.path.join(hf_dir, _INDEX)
    if os.path.exists(index_path):
        index = _read_json(index_path, _INDEX)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{index_path} has no weight_map")
        files = sorted(set(index["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"{hf_dir} has neither model.safetensors nor {_INDEX}")
    for name in files:
        if os.path.basename(name) != name or not os.path.isfile(os.path.join(hf_dir, name)):
            raise UserError(f"{hf_dir}: the weight file {name} named by {_INDEX} is missing")
    return files


def _read_header(path: str) -> bytes:
    """The raw JSON header of a safetensors file, exactly as stored (padding included)."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        size = struct.unpack("<Q", size_bytes)[0] if len(size_bytes) == 8 else -1
        if size < 2 or size > os.path.getsize(path) - 8:
            raise UserError(f"{path} is not a safetensors file (bad header size)")
        return f.read(size)


def _read_hf_tensors(hf_dir: str, files: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """HF name -> tensor over all weight files, and each file's raw header."""
    safetensors = _import_safetensors()
    tensors: dict[str, torch.Tensor] = {}
    headers: dict[str, bytes] = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        headers[name] = _read_header(path)
        try:
            with safetensors.safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise UserError(f"{hf_dir}: tensor {key} is stored twice")
                    tensors[key] = f.get_tensor(key)
        except safetensors.SafetensorError as e:
            raise UserError(f"{path} is not a valid safetensors file ({e})") from None
    return tensors, headers


def _hf_to_ours(hf_tensors: dict[str, torch.Tensor], args: ModelArgs,
                hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Our FQN -> tensor in our layout, and the derived buffers set aside for the sidecar."""
    buffers = {k: v for k, v in hf_tensors.items() if k.endswith(_BUFFER_SUFFIX)}
    ours: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in hf_tensors.items():
        if name in buffers:
            continue
        try:
            fqn = hf_format.from_hf_name(name)
        except KeyError:
            unknown.append(name)
            continue
        ours[fqn] = hf_format.from_hf_tensor(fqn, tensor, args).contiguous()
    if unknown:
        raise UserError(f"{hf_dir} holds tensors that are not LlamaForCausalLM parameters: {sorted(unknown)[0]}" +
                        (f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""))
    if args.tie_word_embeddings and "output.weight" not in ours and "tok_embeddings.weight" in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"]  # our model keeps the tied weight under both names
    return ours, buffers


def _sidecar_writer(hf_dir: str, files: list[str], headers: dict[str, bytes],
                    buffers: dict[str, torch.Tensor]) -> Callable[[str], None]:
    """A function that stores, in a checkpoint folder, what dcp-to-hf needs to rebuild the HF
    folder byte for byte: other top-level files verbatim (config.json, the index, tokenizer
    files...), each safetensors file's header, and any derived buffers."""
    copied = sorted(n for n in os.listdir(hf_dir)
                    if os.path.isfile(os.path.join(hf_dir, n)) and not n.endswith(_WEIGHT_SUFFIXES))

    def write(ckpt: str) -> None:
        root = os.path.join(ckpt, SIDECAR)
        os.makedirs(os.path.join(root, "files"))
        os.makedirs(os.path.join(root, "headers"))
        for name in copied:
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(root, "files", name))
        for name, header in headers.items():
            with open(os.path.join(root, "headers", name + ".header"), "wb") as f:
                f.write(header)
        if buffers:
            _import_safetensors().torch.save_file(buffers, os.path.join(root, "buffers.safetensors"))
        layout = {"format": SIDECAR_FORMAT, "safetensors": files, "copied": copied, "buffers": sorted(buffers)}
        with open(os.path.join(root, "layout.json"), "w") as f:
            json.dump(layout, f, indent=1)

    return write


# ---------------------------------------------------------------------------------------------
# Writing Hugging Face folders


def _hf_order(name: str) -> tuple:
    """Embedding, blocks in order, final norm, output: the order HF's own exports use."""
    if name.startswith("model.layers."):
        parts = name.split(".")
        return (1, int(parts[2]), ".".join(parts[3:]))
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, name)


def _to_hf(model: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out = {hf_format.to_hf_name(k): hf_format.to_hf_tensor(k, v, args).contiguous() for k, v in model.items()}
    return dict(sorted(out.items(), key=lambda kv: _hf_order(kv[0])))


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's data as stored in safetensors (little-endian, row-major)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _exact_plan(hf: dict[str, torch.Tensor], sidecar: str, layout: dict[str, Any], tied: bool) -> dict[str, list] | str:
    """For each original safetensors file, its tensors in data order when the checkpoint's tensors
    still fit the stored headers exactly (names, dtypes, shapes); otherwise why not."""
    if layout.get("buffers"):
        buffers_path = os.path.join(sidecar, "buffers.safetensors")
        hf = {**hf, **_import_safetensors().torch.load_file(buffers_path)}
    plan, used = {}, set()
    for name in layout["safetensors"]:
        with open(os.path.join(sidecar, "headers", name + ".header"), "rb") as f:
            header = json.loads(f.read())
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
        end = 0
        for key, entry in entries:
            tensor = hf.get(key)
            start, stop = entry["data_offsets"]
            if tensor is None or getattr(torch, _ST_DTYPES.get(entry["dtype"], "?"), None) != tensor.dtype:
                return f"{key} is missing or has another dtype"
            if list(tensor.shape) != entry["shape"] or start != end or stop - start != tensor.numel() * tensor.element_size():
                return f"{key} no longer fits its original place"
            end = stop
        plan[name] = [hf[k] for k, _ in entries]
        used.update(k for k, _ in entries)
    left = set(hf) - used - ({"lm_head.weight"} if tied else set())
    return plan if not left else f"{sorted(left)[0]} has no place in the original files"


def _try_exact_plan(hf: dict[str, torch.Tensor], sidecar: str, layout: dict[str, Any], tied: bool) -> dict[str, list] | str:
    try:
        return _exact_plan(hf, sidecar, layout, tied)
    except (OSError, KeyError, TypeError, ValueError) as e:  # a damaged or foreign sidecar: not worth failing for
        return f"the kept original layout cannot be read ({type(e).__name__}: {e})"


def _write_exact(out_tmp: str, sidecar: str, layout: dict[str, Any], plan: dict[str, list]) -> None:
    for name in layout["copied"]:
        shutil.copyfile(os.path.join(sidecar, "files", name), os.path.join(out_tmp, name))
    for name, tensors in plan.items():
        with open(os.path.join(sidecar, "headers", name + ".header"), "rb") as f:
            header = f.read()
        with open(os.path.join(out_tmp, name), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for tensor in tensors:
                f.write(_raw_bytes(tensor))


def _write_fresh(out_tmp: str, hf: dict[str, torch.Tensor], config: dict[str, Any], max_shard_bytes: int) -> None:
    """config.json plus one model.safetensors, or shards and an index when over the shard size."""
    save_file = _import_safetensors().torch.save_file
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_tmp, name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        with open(os.path.join(out_tmp, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out_tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# Commands


def hf_to_dcp(ns: argparse.Namespace) -> str:
    _require_dir(ns.hf_dir, "Hugging Face folder")
    _require_new_output(ns.out_dir)
    _check_model_name(ns.model)
    config = _read_json(os.path.join(ns.hf_dir, "config.json"), "config.json")
    files = _safetensors_files(ns.hf_dir)
    try:
        args = hf_format.model_args_from_hf_config(config if isinstance(config, dict) else {})
    except (ValueError, TypeError) as e:
        raise UserError(f"{ns.hf_dir}/config.json: {e}") from None
    hf_tensors, headers = _read_hf_tensors(ns.hf_dir, files)
    ours, buffers = _hf_to_ours(hf_tensors, args, ns.hf_dir)
    _check_shapes(ours, args, ns.hf_dir)
    manifest = _weights_manifest(ours, ns.model, "hf")
    _write_dcp(ours, ns.out_dir, manifest, _sidecar_writer(ns.hf_dir, files, headers, buffers))
    return _summary(len(hf_tensors), manifest.total_bytes, f"{len(files)} safetensors file(s)", ns.out_dir)


def dcp_to_hf(ns: argparse.Namespace) -> str:
    manifest = _require_checkpoint(ns.ckpt_dir)
    _require_new_output(ns.out_dir)
    if ns.max_shard_size_mb <= 0:
        raise UserError(f"--max-shard-size-mb must be positive, not {ns.max_shard_size_mb}")
    _import_safetensors()
    model = _load_model_entries(ns.ckpt_dir, ns.dtype)
    if ns.vocab_size is not None:
        _drop_padding_rows(model, ns.vocab_size)
    sidecar = os.path.join(ns.ckpt_dir, SIDECAR)
    layout = _read_json(os.path.join(sidecar, "layout.json"), "sidecar") if os.path.isdir(sidecar) else None
    args, config = _hf_args_and_config(ns, manifest, model, sidecar if layout else None)
    hf = _to_hf(model, args)
    plan = _try_exact_plan(hf, sidecar, layout, args.tie_word_embeddings) if layout and not ns.fresh_layout else None
    if isinstance(plan, str) and ns.dtype is None:  # with --dtype a fresh layout is what was asked for
        print(f"warning: writing a fresh layout, not the original files: {plan}", file=sys.stderr)
    if args.tie_word_embeddings:  # HF stores a tied output projection only as the embedding
        hf.pop("lm_head.weight", None)
    tmp = _temporary_sibling(ns.out_dir)
    os.makedirs(tmp)
    try:
        if isinstance(plan, dict):
            _write_exact(tmp, sidecar, layout, plan)
        else:
            _write_fresh(tmp, hf, config, int(ns.max_shard_size_mb * 10**6))
        _move_into_place(tmp, ns.out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    how = "original layout" if isinstance(plan, dict) else "fresh layout"
    return _summary(len(hf), sum(t.numel() * t.element_size() for t in hf.values()), f"{ns.ckpt_dir}, {how}", ns.out_dir)


def _hf_args_and_config(ns: argparse.Namespace, manifest: Manifest, model: dict[str, torch.Tensor],
                        sidecar: str | None) -> tuple[ModelArgs, dict[str, Any]]:
    """The model's args, and the config.json of a fresh layout: the original one (dtype updated)
    when hf-to-dcp kept it, else one generated from the flavor and the tensor shapes."""
    shapes = {k: tuple(v.shape) for k, v in model.items()}
    dtype = _common_dtype(model.values())
    if sidecar is not None:
        original = _read_json(os.path.join(sidecar, "files", "config.json"), "the original config.json")
        args = _args_with_shapes(hf_format.model_args_from_hf_config(original), shapes, ns.n_heads, ns.n_kv_heads)
        return args, {**original, "torch_dtype": dtype}
    args = _args_with_shapes(_registry_args(manifest, ns.n_heads), shapes, ns.n_heads, ns.n_kv_heads)
    return args, hf_format.hf_config(args, torch_dtype=dtype)


def _drop_padding_rows(model: dict[str, torch.Tensor], vocab_size: int) -> None:
    """Keeps the first `vocab_size` embedding and output rows (a padded vocabulary's real ones)."""
    rows = model["tok_embeddings.weight"].shape[0]
    if not 0 < vocab_size <= rows:
        raise UserError(f"--vocab-size {vocab_size} must be between 1 and the embedding's {rows} rows")
    for name in ("tok_embeddings.weight", "output.weight"):
        model[name] = model[name][:vocab_size]


def dcp_to_torch(ns: argparse.Namespace) -> str:
    _require_checkpoint(ns.ckpt_dir)
    _require_new_output(ns.out_file)
    model = _load_model_entries(ns.ckpt_dir, ns.dtype)
    tmp = _temporary_sibling(ns.out_file)
    try:
        torch.save(model, tmp)
        os.replace(tmp, ns.out_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return _summary(len(model), os.path.getsize(ns.out_file), ns.ckpt_dir, ns.out_file)


def torch_to_dcp(ns: argparse.Namespace) -> str:
    if not os.path.isfile(ns.in_file):
        raise UserError(f"input file {ns.in_file} does not exist" if not os.path.exists(ns.in_file)
                        else f"input {ns.in_file} is not a file")
    _require_new_output(ns.out_dir)
    _check_model_name(ns.model, ns.flavor)
    model = _load_torch_file(ns.in_file)
    manifest = _weights_manifest(model, ns.model, ns.flavor or "unknown")
    _write_dcp(model, ns.out_dir, manifest)
    return _summary(len(model), manifest.total_bytes, ns.in_file, ns.out_dir)


def _load_torch_file(path: str) -> dict[str, torch.Tensor]:
    """A state dict of our FQN -> tensor from a torch.save file, loaded with weights_only=True."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The safe unpickler names the global it refused; other unpickling errors mean a foreign file.
        named = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        if named:
            raise UserError(f"{path} needs arbitrary unpickling to load ({named[0]}); refused: only tensors, plain "
                            "containers and numbers are accepted") from None
        raise UserError(f"{path} is not a torch.save file (it is not a pickle torch.load can read safely)") from None
    except Exception as e:  # torch.load fails on foreign files with all kinds of exceptions
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{path} is not a torch.save file ({type(e).__name__}: {first_line})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        raise UserError(f"{path} does not hold a state dict (a dict of parameter name -> tensor)")
    if loaded and all(str(k).startswith("model.") for k in loaded):
        loaded = {k.removeprefix("model."): v for k, v in loaded.items()}
    _check_names(list(loaded), path)
    return loaded


def _check_model_name(name: str, flavor: str | None = None) -> None:
    try:
        spec = get_train_spec(name)
    except (KeyError, ValueError):
        raise UserError(f"unknown --model {name!r}; registered: {', '.join(registered_names())}") from None
    if flavor is not None and flavor not in spec.config:
        raise UserError(f"unknown --flavor {flavor!r} for model {name!r}; choose from {', '.join(spec.config)}")


def _summary(n_tensors: int, nbytes: int, source: str, out: str) -> str:
    return f"{n_tensors} tensors, {nbytes / 2**20:.1f} MiB: {source} -> {out}"


# ---------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one `error:` line, like every other mistake."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="convert_checkpoint.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("hf-to-dcp", help="Hugging Face Llama folder -> weights-only DCP checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--model", default="llama3", help="model name recorded in the manifest (default llama3)")
    p.set_defaults(run=hf_to_dcp)
    p = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> Hugging Face Llama folder (config.json + safetensors)")
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    _dtype_option(p)
    p.add_argument("--max-shard-size-mb", type=float, default=5000,
                   help="largest safetensors file of a fresh layout, in MB of 10**6 bytes as HF counts them (default 5000)")
    p.add_argument("--fresh-layout", action="store_true", help="ignore the original files kept by hf-to-dcp")
    p.add_argument("--n-heads", type=int, help="attention heads (default: the checkpoint's flavor)")
    p.add_argument("--n-kv-heads", type=int, help="key/value heads (default: from the key projection's shape)")
    p.add_argument("--vocab-size", type=int, help="export only the first N embedding/output rows (drops padding rows)")
    p.set_defaults(run=dcp_to_hf)
    p = sub.add_parser("dcp-to-torch", help="DCP checkpoint -> one torch.save file of the model state dict")
    p.add_argument("ckpt_dir")
    p.add_argument("out_file")
    _dtype_option(p)
    p.set_defaults(run=dcp_to_torch)
    p = sub.add_parser("torch-to-dcp", help="torch.save state dict -> weights-only DCP checkpoint")
    p.add_argument("in_file")
    p.add_argument("out_dir")
    p.add_argument("--model", default="llama3", help="model name recorded in the manifest (default llama3)")
    p.add_argument("--flavor", help="flavor recorded in the manifest (lets dcp-to-hf know the head count)")
    p.set_defaults(run=torch_to_dcp)
    return parser


def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=_DTYPES, help="cast floating-point weights (default: keep the stored dtype)")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        summary = ns.run(ns)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"{ns.command}: {summary} in {seconds:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
