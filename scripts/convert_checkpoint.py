#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Converts model weights between this project's DCP checkpoints, Hugging Face safetensors folders and torch.save files.

Any model family whose TrainSpec registers an `hf_adapter` (Llama 2 and 3; Qwen3 and Qwen3-MoE; DeepSeek-V3) can be
converted: the adapter gives its Hugging Face names, tensor layouts and config.json.

Usage examples (from the repository root, with PYTHONPATH=.):

  # A Hugging Face Llama folder -> a weights-only checkpoint that starts a run. The folder's other
  # files (tokenizer.json, tokenizer_config.json, generation_config.json, ...) are kept verbatim in
  # ckpt/llama3_8b/hf/files/; a run that starts from it and leaves model.tokenizer_path at its
  # default uses that tokenizer (one notice line says so).
  python scripts/convert_checkpoint.py hf-to-dcp ~/models/Llama-3.1-8B ckpt/llama3_8b
  python -m torchtitan.train --job.config_file bundled:train_configs/llama3_8b.toml --checkpoint.initial_load_path ckpt/llama3_8b

  # Any checkpoint of ours (full or weights-only) -> a Hugging Face folder. A folder made by hf-to-dcp
  # comes back byte-identical to the original, tokenizer files included; others get a fresh config.json
  # and safetensors shards, plus the tokenizer --tokenizer names (tokenizer.model, or a Hugging Face
  # tokenizer's files by their names), whose bos/eos/pad ids go into config.json.
  python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out --dtype bfloat16 --max-shard-size-mb 4096 \
      --tokenizer bundled:stdlib_docs/tokenizer.model

  # A LoRA run's checkpoint (docs/lora.md) -> merged weights as a Hugging Face folder, or its adapters as a PEFT
  # folder beside the base's Hugging Face folder (the base: the one its run recorded, or --base)
  python scripts/convert_checkpoint.py dcp-to-hf --lora-merge outputs/checkpoint/step-1000 hf_merged
  python scripts/convert_checkpoint.py lora-to-peft outputs/checkpoint/step-1000 peft_adapters

  # One torch.save file of the model state dict (our parameter names), and back
  python scripts/convert_checkpoint.py dcp-to-torch outputs/checkpoint/step-1000 model.pt --dtype bfloat16
  python scripts/convert_checkpoint.py torch-to-dcp model.pt ckpt/from_torch --flavor debugmodel

Inputs are only ever read with safe loaders: safetensors, DCP through a restricted unpickler, and
torch.load(weights_only=True). A user mistake prints one `error: ...` line on stderr, exits with
status 2 and leaves nothing behind; outputs appear under their final name only once complete. So does an
output the disk cannot take (too little free space, checked first; a read-only or full disk while writing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys
import time
from typing import Any

import torch

from torchtitan.assets import resolve_path
from torchtitan.checkpoint import folders, hf_folder, lora_export
from torchtitan.checkpoint.fit import build_on_meta, tied_aliases
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.model_args import RUN_FIELDS, args_record, checkpoint_args
from torchtitan.checkpoint.weights import (
    check_room,
    common_dtype,
    load_model_entries,
    load_torch_file,
    save_torch_file,
    temporary_sibling,
    weights_manifest,
    write_weights,
    writing,
)
from torchtitan.config.manager import JobConfig
from torchtitan.datasets.tokenizer import Tokenizer, TokenizerError, build_tokenizer, hf_config_token_ids
from torchtitan.models import get_train_spec, registered_names
from torchtitan.models.hf_adapter import HFAdapter
from torchtitan.models.train_spec import TrainableModel

_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_MODEL = "llama3"  # --model when not given

# Every user mistake raises CheckpointError (one line), which main() prints as `error: ...` with exit status 2.

# ---------------------------------------------------------------------------------------------
# Checks on paths


def _require_dir(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise CheckpointError(f"{what} {path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{what} {path} is not a folder")


def _require_new_output(path: str) -> None:
    if os.path.isdir(path) and not os.listdir(path):
        return  # an empty folder is replaced
    if os.path.exists(path):
        raise CheckpointError(f"output {path} already exists; remove it or choose another name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CheckpointError(f"the folder {parent} for output {path} does not exist")


def _require_checkpoint(path: str) -> Manifest:
    problem = folders.problem_with(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} {problem}")
    return Manifest.read(path)


# ---------------------------------------------------------------------------------------------
# Model names, shapes and arguments


def _hf_adapter(name: str | None) -> HFAdapter:
    """The HFAdapter of model `name` (--model, or the model a checkpoint's manifest names). A
    checkpoint of a model not registered here (a custom_import one, say) is read with the default
    model's names, which refuse the weights of any other family."""
    spec = get_train_spec(name if name in registered_names() else _DEFAULT_MODEL)
    if spec.hf_adapter is None:
        raise CheckpointError(f"model {spec.name!r} has no hf_adapter in its TrainSpec, so its weights cannot be "
                              "checked or converted here")
    return spec.hf_adapter


def _is_param(adapter: HFAdapter, fqn: str) -> bool:
    """Whether `fqn` is a tensor of the family (None from to_hf_name: one without an HF counterpart)."""
    try:
        adapter.to_hf_name(fqn)
    except KeyError:
        return False
    return True


def _check_names(adapter: HFAdapter, names: list[str], where: str) -> None:
    """Refuses names that are not parameters of the family and sets of names that are not a whole model."""
    unknown = sorted(n for n in names if not _is_param(adapter, n))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise CheckpointError(f"{where} holds tensors that are not {adapter.family} parameters: {unknown[0]}{more}")
    missing = sorted(set(adapter.whole_model_names(names)) - set(names))
    if missing:
        raise CheckpointError(f"{where} is not a whole {adapter.family} model: it lacks {missing[0]}" +
                              (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def _registry_args(manifest: Manifest, n_heads: int | None) -> Any | None:
    """The model args the checkpoint recorded, over those of its flavor (model_args.checkpoint_args);
    None, the family's defaults, when neither is known and --n-heads is given."""
    name, flavor = manifest.model.get("name"), manifest.model.get("flavor")
    try:
        args = checkpoint_args(get_train_spec(name).config, flavor, manifest.model_args)
    except (KeyError, ValueError):
        args = None
    if args is None:
        if n_heads is None:
            raise CheckpointError(f"the checkpoint's model {name} {flavor} is not a registered flavor, so its head count "
                                  "is unknown; pass --n-heads (and --n-kv-heads)")
    return args


def _check_shapes(tensors: dict[str, torch.Tensor], args: Any, model_cls: type[TrainableModel], where: str,
                  source: str = "config.json", fix: str = "") -> None:
    """Refuses tensors whose shapes differ from those of the model `args` (which `source` gives) describe."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_cls.from_model_args(args).state_dict().items()}
    for name, tensor in tensors.items():  # a shape tells more than a block missing at the end
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{where}: {name} has shape {list(tensor.shape)}, but {source} implies "
                                  f"{list(expected[name])}{fix}")
    extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if extra or missing:
        raise CheckpointError((f"{where} holds {extra[0]}, which {source} does not imply" if extra
                               else f"{where} lacks {missing[0]}, which {source} implies") + fix)


def _same_model(args: Any, flavor: Any, model_cls: type[TrainableModel]) -> bool:
    """Whether `args` describe the model of `flavor` whatever its vocabulary (which training takes
    from the tokenizer): the same computation (RUN_FIELDS aside) and the same tensor shapes."""
    ours, theirs = args_record(args), args_record(flavor)
    if any(ours.get(k) != theirs.get(k) for k in ours.keys() | theirs.keys() if k not in (*RUN_FIELDS, "vocab_size")):
        return False
    flavor = dataclasses.replace(flavor, **{k: getattr(args, k) for k in ("vocab_size", "vocab_padding")
                                            if hasattr(args, k) and hasattr(flavor, k)})
    with torch.device("meta"):
        shapes = [{k: v.shape for k, v in model_cls.from_model_args(a).state_dict().items()} for a in (args, flavor)]
    return shapes[0] == shapes[1]


def _converted_manifest(model: dict[str, torch.Tensor], name: str, args: Any | None, source: str,
                        flavor: str | None = None) -> Manifest:
    """The manifest of converted weights, recording what a run's manifest records (the model's args
    and tied weights) so that generation, training (initial_load_path) and export read them as they
    read a run's checkpoint, and where they came from. Their flavor is `flavor`, else the registered
    flavor they are the model of, else "hf" (or "unknown" without args)."""
    spec = get_train_spec(name)
    if flavor is None and args is not None:
        flavor = next((f for f, a in spec.config.items() if _same_model(args, a, spec.model_cls)), "hf")
    manifest = weights_manifest(model, name, flavor or "unknown")
    if args is not None:
        manifest.model_args = args_record(args)
        manifest.tied = tied_aliases(build_on_meta(spec.model_cls, args))
    manifest.converted_from = os.path.abspath(source)
    return manifest


def _hf_args_and_config(ns: argparse.Namespace, manifest: Manifest, model: dict[str, torch.Tensor],
                        sidecar: str | None, tokenizer: Tokenizer | None, adapter: HFAdapter) -> tuple[Any, dict[str, Any]]:
    """The model's args, and the config.json of a fresh layout: the original one (dtype updated)
    when hf-to-dcp kept it, else one generated from the flavor, the tensor shapes and the tokenizer."""
    shapes = {k: tuple(v.shape) for k, v in model.items()}
    dtype = common_dtype(model.values())
    if sidecar is not None:
        original = hf_folder.read_original_config(sidecar)
        try:
            base = adapter.model_args_from_hf_config(original)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{sidecar}/files/config.json: {e}") from None
        kv_heads = getattr(base, "n_kv_heads", None) or base.n_heads  # (DeepSeek-V3's MLA: one per head)
        for flag, given, kept in (("--n-heads", ns.n_heads, base.n_heads), ("--n-kv-heads", ns.n_kv_heads, kv_heads)):
            if given is not None and given != kept:
                raise CheckpointError(f"{flag} {given} contradicts the original config.json kept with the checkpoint "
                                      f"({kept}); leave {flag} out")
        args = adapter.args_with_shapes(base, shapes, ns.n_heads, ns.n_kv_heads)
        # transformers 5 writes `dtype` and prefers it over the older `torch_dtype`: update whichever is there.
        dtype_keys = [k for k in ("torch_dtype", "dtype") if k in original] or ["torch_dtype"]
        # Imports dequantize (DeepSeek-V3's fp8 files); what is written is not quantized.
        config = {k: v for k, v in original.items() if k != "quantization_config"}
        return args, {**config, **dict.fromkeys(dtype_keys, dtype)}
    args = adapter.args_with_shapes(_registry_args(manifest, ns.n_heads), shapes, ns.n_heads, ns.n_kv_heads)
    return args, adapter.hf_config(args, torch_dtype=dtype, **_token_ids(tokenizer))


def _read_tokenizer(path: str) -> Tokenizer:
    """The --tokenizer file or folder, read the way training reads `model.tokenizer_path` (a tiktoken
    rank file, a sentencepiece model, a Hugging Face tokenizer.json or its folder), so that a
    tokenizer training could not use is refused here too."""
    if not os.path.exists(path):
        raise CheckpointError(f"--tokenizer {path} does not exist")
    if not os.path.isfile(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise CheckpointError(f"--tokenizer {path} is neither a file nor a folder holding tokenizer.json")
    job_config = JobConfig()
    job_config.model.tokenizer_path = path
    try:
        return build_tokenizer(job_config)
    except (TokenizerError, ImportError) as e:
        raise CheckpointError(f"--tokenizer: {e}") from None


def _token_ids(tokenizer: Tokenizer | None) -> dict[str, int | None]:
    """bos/eos (and pad, where defined) ids for config.json; transformers would otherwise assume 1 and 2."""
    return {} if tokenizer is None else hf_config_token_ids(tokenizer)


def _drop_padding_rows(model: dict[str, torch.Tensor], vocab_size: int, adapter: HFAdapter) -> None:
    """Keeps the first `vocab_size` embedding and output rows (a padded vocabulary's real ones)."""
    (embedding,), (output,) = adapter.from_hf_names(hf_folder.HF_EMBEDDING), adapter.from_hf_names(hf_folder.HF_OUTPUT)
    rows = model[embedding].shape[0]
    if not 0 < vocab_size <= rows:
        raise CheckpointError(f"--vocab-size {vocab_size} must be between 1 and the embedding's {rows} rows")
    for name in (embedding, output):
        model[name] = model[name][:vocab_size]


def _check_model_name(name: str, flavor: str | None = None) -> None:
    try:
        spec = get_train_spec(name)
    except (KeyError, ValueError):
        raise CheckpointError(f"unknown --model {name!r}; registered: {', '.join(registered_names())}") from None
    if flavor is not None and flavor not in spec.config:
        raise CheckpointError(f"unknown --flavor {flavor!r} for model {name!r}; choose from {', '.join(spec.config)}")


# ---------------------------------------------------------------------------------------------
# Commands


def hf_to_dcp(ns: argparse.Namespace) -> str:
    _require_dir(ns.hf_dir, "Hugging Face folder")
    _require_new_output(ns.out_dir)
    config = hf_folder.read_json(os.path.join(ns.hf_dir, "config.json"), "config.json")
    if ns.model is None:  # the family that reads config.json; else the default's names refuse the folder
        ns.model = (hf_folder.family_of(config, _DEFAULT_MODEL) or (_DEFAULT_MODEL,))[0]
    _check_model_name(ns.model)
    adapter = _hf_adapter(ns.model)
    files = hf_folder.safetensors_files(ns.hf_dir)
    try:
        args = adapter.model_args_from_hf_config(config if isinstance(config, dict) else {})
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{ns.hf_dir}/config.json: {e}") from None
    hf_tensors, headers = hf_folder.read_hf_tensors(ns.hf_dir, files)
    ours, buffers = hf_folder.hf_to_ours(hf_tensors, args, adapter, ns.hf_dir)
    _check_shapes(ours, args, get_train_spec(ns.model).model_cls, ns.hf_dir)
    manifest = _converted_manifest(ours, ns.model, args, ns.hf_dir)
    check_room(ns.out_dir, _nbytes(ours))
    with writing(ns.out_dir):
        write_weights(ours, ns.out_dir, manifest, hf_folder.sidecar_writer(ns.hf_dir, files, headers, buffers))
    return _summary(len(hf_tensors), manifest.total_bytes, f"{len(files)} safetensors file(s)", ns.out_dir)


def dcp_to_hf(ns: argparse.Namespace) -> str:
    manifest = _require_checkpoint(ns.ckpt_dir)
    _require_new_output(ns.out_dir)
    if ns.max_shard_size_mb <= 0:
        raise CheckpointError(f"--max-shard-size-mb must be positive, not {ns.max_shard_size_mb}")
    hf_folder.import_safetensors()
    if ns.tokenizer is not None:  # a bundled: name becomes the shipped file's path, read and copied below
        ns.tokenizer = resolve_path(ns.tokenizer, "--tokenizer", CheckpointError)
    tokenizer = _read_tokenizer(ns.tokenizer) if ns.tokenizer is not None else None
    adapter = _hf_adapter(manifest.model.get("name"))
    model = _model_weights(ns, manifest, adapter)
    if ns.vocab_size is not None:
        _drop_padding_rows(model, ns.vocab_size, adapter)
    sidecar = os.path.join(ns.ckpt_dir, hf_folder.SIDECAR)
    layout = hf_folder.read_layout(sidecar) if os.path.isdir(sidecar) else None
    args, config = _hf_args_and_config(ns, manifest, model, sidecar if layout else None, tokenizer, adapter)
    if tokenizer is not None and tokenizer.n_words > args.vocab_size:
        raise CheckpointError(f"--tokenizer {ns.tokenizer} has {tokenizer.n_words} tokens, more than the model's "
                              f"{args.vocab_size} embedding rows")
    hf = hf_folder.to_hf(model, args, adapter)
    tied = adapter.ties_embeddings(args)
    plan = hf_folder.try_exact_plan(hf, sidecar, layout, tied) if layout and not ns.fresh_layout else None
    if isinstance(plan, str) and ns.dtype is None and ns.vocab_size is None:  # those ask for a fresh layout
        print(f"warning: writing a fresh layout, not the original files: {plan}", file=sys.stderr)
    if tied:  # HF stores a tied output projection only as the embedding
        hf.pop(hf_folder.HF_OUTPUT, None)
    check_room(ns.out_dir, _nbytes(hf))
    tmp = temporary_sibling(ns.out_dir)
    with writing(ns.out_dir):
        os.makedirs(tmp)
        try:
            _write_hf_files(tmp, ns, hf, config, sidecar, layout, plan, tokenizer)
            if os.path.isdir(ns.out_dir):  # an empty folder, accepted by _require_new_output
                os.rmdir(ns.out_dir)
            os.rename(tmp, ns.out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    how = "original layout" if isinstance(plan, dict) else "fresh layout"
    return _summary(len(hf), _nbytes(hf), f"{ns.ckpt_dir}, {how}", ns.out_dir)


def _model_weights(ns: argparse.Namespace, manifest: Manifest, adapter: HFAdapter) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights; with --lora-merge, its LoRA adapters merged into their base."""
    check = functools.partial(_check_names, adapter)
    if not ns.lora_merge:
        if manifest.lora:
            raise CheckpointError(f"checkpoint {ns.ckpt_dir} holds LoRA adapters: add --lora-merge to export them "
                                  "merged into their base, or use lora-to-peft for a PEFT adapter folder")
        return load_model_entries(ns.ckpt_dir, ns.dtype, check_names=check)
    weights, adapters = lora_export.read_adapters(ns.ckpt_dir, manifest, ns.base, check)
    model = lora_export.merged(weights, adapters, lora_export.lora_record(ns.ckpt_dir, manifest), ns.ckpt_dir)
    cast = getattr(torch, ns.dtype) if ns.dtype else None
    return {k: v.to(cast) if cast is not None and v.is_floating_point() else v for k, v in model.items()}


def lora_to_peft(ns: argparse.Namespace) -> str:
    """A LoRA checkpoint's adapters as a PEFT folder (torchtitan/checkpoint/lora_export.py)."""
    manifest = _require_checkpoint(ns.ckpt_dir)
    _require_new_output(ns.out_dir)
    record = lora_export.lora_record(ns.ckpt_dir, manifest)
    adapter = _hf_adapter(manifest.model.get("name"))
    spec = get_train_spec(manifest.model.get("name"))
    whole = build_on_meta(spec.model_cls, _registry_args(manifest, None)).state_dict()  # shapes, no memory
    args, _ = _hf_args_and_config(ns, manifest, whole, None, None, adapter)
    tensors, modules = lora_export.peft_tensors(lora_export.adapter_entries(ns.ckpt_dir), args, adapter)
    config = lora_export.peft_config(record, modules, lora_export.hf_modules(whole, args, adapter), ns.base_name)
    check_room(ns.out_dir, _nbytes(tensors))
    tmp = temporary_sibling(ns.out_dir)
    with writing(ns.out_dir):
        os.makedirs(tmp)
        try:
            lora_export.write_peft(tmp, tensors, config)
            hf_folder.give_default_modes(tmp)
            if os.path.isdir(ns.out_dir):  # an empty folder, accepted by _require_new_output
                os.rmdir(ns.out_dir)
            os.rename(tmp, ns.out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _summary(len(tensors), _nbytes(tensors), f"{ns.ckpt_dir}, {len(modules)} adapted modules", ns.out_dir)


def _write_hf_files(tmp: str, ns: argparse.Namespace, hf: dict[str, torch.Tensor], config: dict[str, Any], sidecar: str,
                    layout: dict[str, Any] | None, plan: dict[str, list] | str | None,
                    tokenizer: Tokenizer | None) -> None:
    """The exported folder's files, into `tmp`: the original files rebuilt when `plan` says they fit,
    else config.json and fresh shards (plus the original folder's other files, when kept: its
    tokenizer files among them); then the --tokenizer's files over any kept ones (tokenizer.model,
    or a Hugging Face tokenizer's tokenizer.json and config files), and the modes of any file the
    user creates."""
    if isinstance(plan, dict):
        hf_folder.write_exact(tmp, sidecar, layout, plan)
    else:
        if layout is not None:  # the original tokenizer and generation files; config and index are new
            hf_folder.copy_kept_files(tmp, sidecar, layout, skip=("config.json", hf_folder.INDEX))
        hf_folder.write_fresh(tmp, hf, config, int(ns.max_shard_size_mb * 10**6))
    for name, path in (tokenizer.files() if tokenizer is not None else {}).items():
        shutil.copyfile(path, os.path.join(tmp, name))
    hf_folder.give_default_modes(tmp)


def dcp_to_torch(ns: argparse.Namespace) -> str:
    manifest = _require_checkpoint(ns.ckpt_dir)
    _require_new_output(ns.out_file)
    adapter = _hf_adapter(manifest.model.get("name"))
    model = load_model_entries(ns.ckpt_dir, ns.dtype, check_names=functools.partial(_check_names, adapter))
    check_room(ns.out_file, _nbytes(model))
    with writing(ns.out_file):
        save_torch_file(model, ns.out_file)
    return _summary(len(model), os.path.getsize(ns.out_file), ns.ckpt_dir, ns.out_file)


def torch_to_dcp(ns: argparse.Namespace) -> str:
    if not os.path.isfile(ns.in_file):
        raise CheckpointError(f"input file {ns.in_file} does not exist" if not os.path.exists(ns.in_file)
                              else f"input {ns.in_file} is not a file")
    _require_new_output(ns.out_dir)
    _check_model_name(ns.model, ns.flavor)
    adapter = _hf_adapter(ns.model)
    model = load_torch_file(ns.in_file)
    _check_names(adapter, list(model), ns.in_file)
    args = None
    if ns.flavor is not None:  # the flavor's args, checked against every tensor; the vocabulary is the weights'
        spec = get_train_spec(ns.model)
        (embedding,) = adapter.from_hf_names(hf_folder.HF_EMBEDDING)
        flavor = spec.config[ns.flavor]
        vocabulary = {"vocab_size": model[embedding].shape[0], "vocab_padding": 0}  # every row becomes a token
        args = dataclasses.replace(flavor, **{k: v for k, v in vocabulary.items() if hasattr(flavor, k)})
        _check_shapes(model, args, spec.model_cls, ns.in_file, f"--flavor {ns.flavor}",
                      "; name the flavor that wrote the weights, or leave --flavor out")
    manifest = _converted_manifest(model, ns.model, args, ns.in_file, ns.flavor)
    check_room(ns.out_dir, _nbytes(model))
    with writing(ns.out_dir):
        write_weights(model, ns.out_dir, manifest)
    return _summary(len(model), manifest.total_bytes, ns.in_file, ns.out_dir)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


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
    p = sub.add_parser("hf-to-dcp", help="Hugging Face folder (Llama, Qwen3, DeepSeek-V3, ...) -> weights-only DCP checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--model", help="model name recorded in the manifest, whose Hugging Face names and layouts are used "
                   "(default: the registered model whose config.json reader takes the folder's architecture, llama3 "
                   "for a Llama)")
    p.set_defaults(run=hf_to_dcp)
    p = sub.add_parser("dcp-to-hf", help="DCP checkpoint -> Hugging Face folder (config.json + safetensors)")
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    _dtype_option(p)
    p.add_argument("--max-shard-size-mb", type=float, default=5000,
                   help="largest safetensors file of a fresh layout, in MB of 10**6 bytes as HF counts them (default 5000)")
    p.add_argument("--fresh-layout", action="store_true",
                   help="write fresh safetensors shards even where the original files kept by hf-to-dcp fit "
                        "(their config.json and other files are still used)")
    p.add_argument("--n-heads", type=int, help="attention heads (default: the checkpoint's flavor)")
    p.add_argument("--n-kv-heads", type=int, help="key/value heads (default: from the key projection's shape)")
    p.add_argument("--vocab-size", type=int, help="export only the first N embedding/output rows (drops padding rows)")
    p.add_argument("--tokenizer", help="the run's tokenizer (model.tokenizer_path: a tiktoken or sentencepiece file, "
                                       "copied as tokenizer.model; a Hugging Face tokenizer.json or its folder, whose "
                                       "tokenizer files are copied by name; or a bundled: name such as "
                                       "bundled:stdlib_docs/tokenizer.model); its bos/eos ids go into a generated "
                                       "config.json. A checkpoint made by hf-to-dcp brings back its own tokenizer "
                                       "files without it")
    p.add_argument("--lora-merge", action="store_true",
                   help="the checkpoint is a LoRA run's: export its base with the adapters merged in (W + alpha/rank B A)")
    p.add_argument("--base", help="with --lora-merge: the base model, a checkpoint or Hugging Face folder (default: the "
                                  "checkpoint.initial_load_path its run recorded)")
    p.set_defaults(run=dcp_to_hf)
    p = sub.add_parser("lora-to-peft", help="LoRA checkpoint -> PEFT adapter folder (adapter_config.json + "
                                            "adapter_model.safetensors) for the base model's Hugging Face folder")
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    p.add_argument("--base-name", help="adapter_config.json's base_model_name_or_path (default: none)")
    p.set_defaults(run=lora_to_peft, n_heads=None, n_kv_heads=None)
    p = sub.add_parser("dcp-to-torch", help="DCP checkpoint -> one torch.save file of the model state dict")
    p.add_argument("ckpt_dir")
    p.add_argument("out_file")
    _dtype_option(p)
    p.set_defaults(run=dcp_to_torch)
    p = sub.add_parser("torch-to-dcp", help="torch.save state dict -> weights-only DCP checkpoint")
    p.add_argument("in_file")
    p.add_argument("out_dir")
    p.add_argument("--model", default=_DEFAULT_MODEL, help="model name recorded in the manifest, whose Hugging Face "
                   "names and layouts are used (default llama3)")
    p.add_argument("--flavor", help="the flavor the weights are, checked against their shapes (all but the vocabulary's, "
                                    "which they give) and recorded with its model args, so that generation, training "
                                    "and dcp-to-hf know the model; without it they know none")
    p.set_defaults(run=torch_to_dcp)
    return parser


def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=_DTYPES, help="cast floating-point weights (default: keep the stored dtype)")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        summary = ns.run(ns)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"{ns.command}: {summary} in {seconds:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
