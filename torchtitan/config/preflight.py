"""The checks and builds a job passes before any process group exists: the rule phases shapes,
layout, model and device of torchtitan/config/rules.py (parse_args ran the options phase), with
the builds they check: the TrainSpec, the tokenizer, the model's arguments, the model on the meta
device. One line and exit code 2 for each mistake. The model and device rules are defined here or
in the module of the feature they protect.

The one module of config/ above the features (it builds ParallelDims, the plan and the model): no
other config module imports it (tests/unit_tests/test_import_graph.py)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import os
from typing import Any, NamedTuple

import torch

from torchtitan.checkpoint.folders import MANIFEST
from torchtitan.config import rules
from torchtitan.config.job_config import JobConfig, Model
from torchtitan.errors import ConfigError
from torchtitan.models import TrainSpec, get_train_spec
from torchtitan.parallelisms.mixed_precision import warn_if_emulated
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.runtime import device_setup

logger = logging.getLogger("torchtitan")


def check_flavor(train_spec: TrainSpec, flavor: str) -> None:
    if flavor not in train_spec.config:
        raise ConfigError(
            f"unknown model.flavor {flavor!r} for model {train_spec.name!r}; choose from {', '.join(train_spec.config)}"
        )


def initial_vocab_rows(job_config: JobConfig) -> int | None:
    """The embedding rows of the weights checkpoint.initial_load_path names (a Hugging Face folder's
    config.json, a converted checkpoint's recorded args), None where they are not recorded."""
    path = job_config.checkpoint.initial_load_path
    if not path or not os.path.isdir(path):
        return None
    args = None
    for name in ("config.json", MANIFEST):
        try:
            with open(os.path.join(path, name)) as f:
                found = json.load(f)
        except (OSError, ValueError):
            continue
        args = found if name == "config.json" else found.get("model_args")  # a converted checkpoint's manifest
        break
    # A checkpoint of ours records its padding rows apart (vocab_padding): its vocabulary is vocab_size.
    return args.get("vocab_size") if isinstance(args, dict) and isinstance(args.get("vocab_size"), int) else None


def build_model_args(train_spec: TrainSpec, job_config: JobConfig, vocab_size: int):
    """The flavor's args with the job's vocabulary, sequence length and options. The vocabulary is
    the tokenizer's, or the embedding rows of the weights the run starts from where they have more
    (Qwen3 publishes 151,936 rows for its 151,669 tokens): the model is then theirs, as transformers
    computes it, and the rows no token reaches are never targets (and never generated: generation
    samples below the tokenizer's size). It is padded up to `model.vocab_size_divisible_by`."""
    model = job_config.model
    flavor = train_spec.config[model.flavor]
    rows = initial_vocab_rows(job_config)
    if rows is not None and rows > vocab_size:
        vocab_size = rows
    # vocab_size is required of every model's args; the others are set where the model has them.
    updates = {"vocab_size": vocab_size, "max_seq_len": job_config.training.seq_len, "norm_type": model.norm_type,
               "moe_aux_loss_coef": job_config.moe.aux_loss_coef, "moe_bias_update_rate": job_config.moe.bias_update_rate,
               "mtp_loss_weight": model.mtp_loss_weight}
    if model.mtp_depth >= 0:
        updates["mtp_depth"] = model.mtp_depth
    padding = -vocab_size % model.vocab_size_divisible_by
    if padding:
        if not hasattr(flavor, "vocab_padding"):
            raise ConfigError(f"model.vocab_size_divisible_by: model {model.name!r} cannot pad its vocabulary (its args have "
                              "no vocab_padding field); leave it at 1")
        updates["vocab_padding"] = padding
    return dataclasses.replace(flavor, **{k: v for k, v in updates.items() if k == "vocab_size" or hasattr(flavor, k)})


def check_document_mask(job_config: JobConfig, tokenizer: Any, model_cls: type | None = None) -> None:
    """training.document_mask cuts windows at end-of-text tokens, and training.mask_loss_after_eos
    ignores the labels after them, so the tokenizer must have one (not for conversations, which
    carry their document ids); document masking, and packed conversations, hand the model
    `document_ids`, so its forward must take them."""
    training, sft = job_config.training, job_config.sft
    options = [name for name, on in (("training.document_mask", training.document_mask),
                                     ("training.mask_loss_after_eos", training.mask_loss_after_eos)) if on]
    eos_id = getattr(tokenizer, "eos_id", None)
    # Packed conversations carry their own document ids (datasets/sft.py): no end-of-text needed.
    if options and not sft.format and (eos_id is None or eos_id < 0):
        raise ConfigError(f"{options[0]} needs an end-of-text token to tell where documents end; the "
                          f"tokenizer {job_config.model.tokenizer_path} has none (eos_id {eos_id}); use a tokenizer "
                          f"with one, or leave {options[0]} off")
    masked = "training.document_mask" if training.document_mask else \
        "sft.packing" if sft.format and sft.packing else None
    if masked and model_cls is not None and "document_ids" not in inspect.signature(model_cls.forward).parameters:
        fix = "leave training.document_mask off" if training.document_mask else "set sft.packing false"
        raise ConfigError(f"{masked}: model {job_config.model.name!r} takes no document_ids in its forward (see "
                          f"torchtitan/models/llama/model.py), so packed documents cannot be kept apart; {fix} for it")


def check_pipelining_fn(train_spec: TrainSpec, parallel_dims: ParallelDims) -> None:
    if parallel_dims.pp_enabled and train_spec.pipelining_fn is None:
        raise ConfigError(f"model {train_spec.name!r} has no pipelining_fn, so experimental.pipeline_parallel_degree "
                          "must stay 1")


def check_hf_adapter(job_config: JobConfig, train_spec: TrainSpec) -> None:
    if job_config.checkpoint.last_save_in_hf and train_spec.hf_adapter is None:
        raise ConfigError(f"checkpoint.last_save_in_hf: model {train_spec.name!r} has no Hugging Face conversion "
                          "(TrainSpec.hf_adapter)")


def check_validation_loader(job_config: JobConfig, train_spec: TrainSpec) -> None:
    if job_config.validation.enabled and train_spec.build_validation_dataloader_fn is None:
        raise ConfigError(f"model {train_spec.name!r} has no build_validation_dataloader_fn, so validation.enabled "
                          "must stay false")


def check_experts(job_config: JobConfig, train_spec: TrainSpec, parallel_dims: ParallelDims,
                  model: torch.nn.Module) -> None:
    """Expert parallelism splits a model's experts (modules with `num_experts`); a model with none
    has nothing to split. The one place this is checked, for every model family."""
    ep = parallel_dims.ep
    if ep == 1 or any(hasattr(m, "num_experts") for m in model.modules()):
        return
    needs = f"training.expert_parallel_degree {ep} needs a mixture-of-experts model"
    model_name = f"{job_config.model.name} {job_config.model.flavor}"
    moe_flavors = [name for name, args in train_spec.config.items() if getattr(args, "num_experts", 0)]
    if moe_flavors:
        raise ConfigError(f"{needs}; model {model_name} is dense (use a mixture-of-experts flavor: "
                          f"{', '.join(moe_flavors)}; or leave it at 1)")
    raise ConfigError(f"{needs}; {model_name} has no experts (leave it at 1)")


def check_mtp(job_config: JobConfig, train_spec: TrainSpec) -> None:
    """model.mtp_depth > 0 needs a family with multi-token prediction modules (an `mtp_depth` field),
    and is not computed chunked (training.loss_chunk_size)."""
    depth = job_config.model.mtp_depth
    if depth > 0 and not hasattr(train_spec.config[job_config.model.flavor], "mtp_depth"):
        raise ConfigError(f"model.mtp_depth {depth}: model {job_config.model.name!r} has no multi-token prediction "
                          "(deepseek_v3 has); leave it at -1 or 0")
    effective = depth if depth >= 0 else getattr(train_spec.config[job_config.model.flavor], "mtp_depth", 0)
    weight = job_config.model.mtp_loss_weight
    if effective == 0 and weight != Model().mtp_loss_weight and os.environ.get("RANK", "0") == "0":
        # Only here is the model's depth known (the pre-check has no model registry); said once, as
        # the pre-check's notices are.
        logger.warning(f"notice: model.mtp_loss_weight {weight} has no effect: it weighs the multi-token prediction "
                       f"loss, and model {job_config.model.name} {job_config.model.flavor} has none in this job "
                       "(model.mtp_depth 0)")
    if job_config.training.loss_chunk_size and effective > 0:
        # MTP projects its own hidden states through the shared output, whose chunked head returns a loss.
        raise ConfigError(f"training.loss_chunk_size does not compose with multi-token prediction (model.mtp_depth "
                          f"{effective}); set model.mtp_depth 0 or training.loss_chunk_size 0")


def check_model_shapes(train_spec: TrainSpec, model_args: Any, parallel_dims: ParallelDims,
                       plan: PipelinePlan | None, job_config: JobConfig) -> None:
    """The model family's own rules (its TrainSpec's validate_fn): head and vocabulary counts
    against TP, enough blocks for the pipeline's stages, ..."""
    if train_spec.validate_fn is not None:
        train_spec.validate_fn(model_args, parallel_dims, plan, job_config)


def _import_custom_models(module: str) -> None:
    try:
        importlib.import_module(module)  # registers extra models
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise  # the module exists but imports something missing: its own bug
        raise ConfigError(f"experimental.custom_import {module!r}: no module named {e.name!r} on the Python path "
                          f"(run from the folder that holds it, or add that folder to PYTHONPATH)") from None


class Preflight(NamedTuple):
    """What a job is checked and built from before any process group exists."""

    parallel_dims: ParallelDims
    pipeline_plan: PipelinePlan | None  # built once here, passed to validate_fn and pipelining_fn
    train_spec: TrainSpec
    tokenizer: Any
    model_args: Any
    model: torch.nn.Module  # on the meta device: shapes only, no memory


def preflight(job_config: JobConfig, world_size: int, device_type: str | None = None,
              check_memory: bool = True, tokenizer: Any = None) -> Preflight:
    """The rule phases shapes, layout, model and device (torchtitan/config/rules.py), in the order
    a run meets them; raises ConfigError (or another user error) with one line. Runs on every rank
    before start-up, and in-process wherever a layout must be judged without starting it (the
    layout matrix, the dry run).

    `device_type`: the device the job runs on (this machine's by default; a dry run names the
    cluster's). `check_memory` False leaves out the start-up memory floor (a dry run measures).
    `tokenizer`: one already built (the dry run's stand-in where the file is on the cluster only)."""
    plan = rules.check_shapes(job_config)
    parallel_dims = rules.check_layout(job_config, world_size)
    rules.run("output_locations", job_config)
    if job_config.experimental.custom_import:
        _import_custom_models(job_config.experimental.custom_import)
    train_spec = get_train_spec(job_config.model.name)
    rules.run("flavor", train_spec, job_config.model.flavor)
    tokenizer = tokenizer or train_spec.build_tokenizer_fn(job_config)
    rules.run("document_mask", job_config, tokenizer, train_spec.model_cls)
    model_args = build_model_args(train_spec, job_config, tokenizer.n_words)
    rules.run("pipelining_fn", train_spec, parallel_dims)
    rules.run("hf_export", job_config, train_spec)
    rules.run("export_target", job_config)
    rules.run("validation_loader", job_config, train_spec)
    with torch.device("meta"):
        model = train_spec.model_cls.from_model_args(model_args)
    rules.run("experts", job_config, train_spec, parallel_dims, model)
    rules.run("muon_exclude", job_config, model)
    rules.run("lora_targets", job_config, model)
    rules.run("mtp", job_config, train_spec)
    rules.run("model_shapes", train_spec, model_args, parallel_dims, plan, job_config)
    device_type = device_type or device_setup.device_type()
    rules.run("async_tp_device", job_config, device_type)
    rules.run("float8_device", job_config, device_type, parallel_dims.tp_enabled)
    rules.run("memory_snapshot_device", job_config, device_type)
    warn_if_emulated(job_config.training, device_type)
    if check_memory:
        rules.run("memory_floor", job_config, parallel_dims, model_args, device_type,
                  sum(p.numel() for p in model.parameters()))
    return Preflight(parallel_dims, plan, train_spec, tokenizer, model_args, model)
