"""Exports of a LoRA run's checkpoint, in one process (scripts/convert_checkpoint.py; docs/lora.md).

Two forms. Merged: each adapted weight becomes W + (alpha / rank) * B @ A, and the whole model goes
through the family's usual Hugging Face conversion (`dcp-to-hf --lora-merge`). PEFT: the adapters
alone as a folder that `peft.PeftModel.from_pretrained(base, folder)` loads beside the base model's
Hugging Face folder (`lora-to-peft`): `adapter_config.json` (rank, alpha, the adapted modules by
their Hugging Face names) and `adapter_model.safetensors` (`base_model.model.<HF module>.lora_A.weight`
and `.lora_B.weight`).

The families' conversions reorder a weight's rows (the RoPE pairing of q and k), never its columns,
so lora_A (rank x in) keeps its layout and lora_B (out x rank) takes the rows its weight takes; B is
converted as the weight B @ [I 0] would be, which the conversion is checked to leave zero beyond
the rank's columns. Adapters of DeepSeek-V3's multi-token prediction modules have no module to
attach to in transformers' model (which has no MTP layers) and are left out of the PEFT folder.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.hf_training import is_hf_folder
from torchtitan.checkpoint.weights import load_model_entries
from torchtitan.models.hf_adapter import HFAdapter
from torchtitan.parallelisms.lora_linear import is_adapter_name, merge_weight

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_A, _B = ".lora_a.weight", ".lora_b.weight"


def lora_record(ckpt: str, manifest: Manifest) -> dict[str, Any]:
    """The checkpoint's LoRA record (Manifest.lora); refuses a checkpoint without one."""
    if not manifest.lora:
        raise CheckpointError(f"checkpoint {ckpt} holds no LoRA adapters (its manifest records no lora: it was not "
                              "written by a run with lora.rank > 0)")
    return manifest.lora


def adapter_entries(ckpt: str) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA checkpoint by our names (`layers.0.attention.wq.lora_a.weight`, ...)."""
    return _adapters_and_weights(ckpt)[0]


def _adapters_and_weights(ckpt: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    entries = load_model_entries(ckpt)
    adapters = {k: v for k, v in entries.items() if is_adapter_name(k)}
    if not adapters:
        raise CheckpointError(f"checkpoint {ckpt} records LoRA but holds no adapter weights")
    return adapters, {k: v for k, v in entries.items() if not is_adapter_name(k)}


def read_adapters(ckpt: str, manifest: Manifest, base: str | None,
                  check_names: Callable[[list[str], str], None] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the base model's weights, the adapters) of a LoRA checkpoint, by our names. The base comes
    from the checkpoint itself when it holds the whole model, else from `base` or the base its run
    recorded (a checkpoint of ours, or a Hugging Face folder). `check_names` vets the base's names."""
    record = lora_record(ckpt, manifest)
    path = base or record.get("base") or ""  # the run recorded its checkpoint.initial_load_path, required
    if record.get("adapters_only"):  # the base is checked before anything is read
        if base and not os.path.isdir(base):
            raise CheckpointError(f"--base {base} does not exist; name the base model's checkpoint or Hugging Face folder")
        if not os.path.isdir(path):
            raise CheckpointError(f"the base model {path!r} of checkpoint {ckpt} does not exist; pass --base with the "
                                  "base model's checkpoint or Hugging Face folder")
    adapters, weights = _adapters_and_weights(ckpt)  # weights: the base, when the run saved the whole model
    if record.get("adapters_only"):
        weights = _read_base(path, manifest.model.get("name"))
    if check_names is not None:
        check_names(list(weights), f"the base model of {ckpt}")
    return weights, adapters


def _read_base(path: str, model_name: str | None) -> dict[str, torch.Tensor]:
    """Our FQN -> tensor of a base model: a checkpoint of ours, or a Hugging Face folder converted as
    hf-to-dcp converts it."""
    if not is_hf_folder(path):
        return load_model_entries(path)
    from torchtitan.models import get_train_spec  # the registry, only where a Hugging Face base needs it

    adapter = get_train_spec(model_name).hf_adapter  # the exporter has found it (convert_checkpoint._hf_adapter)
    config = hf_folder.read_json(os.path.join(path, "config.json"), "config.json")
    args = adapter.model_args_from_hf_config(config if isinstance(config, dict) else {})
    tensors, _ = hf_folder.read_hf_tensors(path, hf_folder.safetensors_files(path))
    return hf_folder.hf_to_ours(tensors, args, adapter, path)[0]


def _layers(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The adapted layers' names (`layers.0.attention.wq`), in the checkpoint's order."""
    return [k.removesuffix(_A) for k in adapters if k.endswith(_A)]


def merged(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], record: dict[str, Any],
           where: str) -> dict[str, torch.Tensor]:
    """`weights` with each adapted layer's weight replaced by W + (alpha / rank) * B @ A."""
    scale = record["alpha"] / record["rank"]
    out = dict(weights)
    for layer in _layers(adapters):
        name = f"{layer}.weight"
        a, b = adapters[layer + _A], adapters[layer + _B]
        shape = list(out[name].shape) if name in out else "missing"
        if shape != [b.shape[0], a.shape[1]]:
            raise CheckpointError(f"the base model of {where} does not fit its adapters: {name} is {shape} there, the "
                                  f"adapters make {[b.shape[0], a.shape[1]]}; pass --base with the model they were "
                                  "trained on")
        out[name] = merge_weight(out[name], a, b, scale)
    return out


def peft_tensors(adapters: dict[str, torch.Tensor], args: Any, adapter: HFAdapter) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The PEFT folder's tensors by PEFT's names, and the adapted modules' Hugging Face names."""
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for layer in _layers(adapters):
        if layer.startswith("mtp."):  # no such layer in transformers' model (see the module's docstring)
            continue
        a, b = adapters[layer + _A], adapters[layer + _B]
        rank, in_features = a.shape
        # The rows of B as the conversion lays out the weight's: B @ [I 0], then its first `rank` columns.
        probe = torch.cat([b, b.new_zeros(b.shape[0], in_features - rank)], 1)
        for hf_name, converted in adapter.to_hf_tensors(f"{layer}.weight", probe, args).items():
            if converted[:, rank:].any():  # a family's conversion this exporter does not know yet
                raise NotImplementedError(f"{layer}: its Hugging Face conversion mixes the weight's columns, so its "
                                          "adapters cannot be exported as PEFT adapters; export merged weights instead")
            module = hf_name.removesuffix(".weight")
            modules.append(module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = converted[:, :rank].contiguous()
    return tensors, modules


def hf_modules(whole: dict[str, torch.Tensor], args: Any, adapter: HFAdapter) -> list[str]:
    """The Hugging Face names of every weight-holding module of the model `whole` (our names ->
    tensors, meta ones do), the MTP modules aside as in `peft_tensors`."""
    ours = {k: v for k, v in whole.items() if not k.startswith("mtp.")}
    return [n.removesuffix(".weight") for n in hf_folder.to_hf(ours, args, adapter) if n.endswith(".weight")]


def peft_config(record: dict[str, Any], modules: list[str], all_modules: list[str], base_name: str | None) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig of the adapters. Its target_modules are the adapted
    modules' last names (q_proj, ...) when those name exactly the adapted ones among the model's
    `all_modules`, else the adapted modules' full names."""
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    named_by_leaves = {m for m in all_modules if m.rsplit(".", 1)[-1] in leaves} == set(modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": record["rank"], "lora_alpha": record["alpha"], "lora_dropout": record.get("dropout", 0.0),
            "target_modules": sorted(leaves if named_by_leaves else modules), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None}


def write_peft(out_tmp: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The PEFT folder's two files, into `out_tmp` (the caller publishes it)."""
    safetensors = hf_folder.import_safetensors()
    safetensors.torch.save_file(tensors, os.path.join(out_tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_tmp, PEFT_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
