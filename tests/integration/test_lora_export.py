"""A LoRA run's exports against the reference, transformers and peft (scripts/convert_checkpoint.py
dcp-to-hf --lora-merge and lora-to-peft; docs/lora.md). Per family: a seed (the base), 3 LoRA
steps in one process saving the adapters alone, then in this process the base as a Hugging Face
folder (the existing dcp-to-hf), the merged folder and the PEFT folder. peft loads the PEFT folder
beside the base and gives our adapted model's logits; its merge_and_unload gives our merged
folder's. DeepSeek-V3 adapts its attention only: peft 0.21 with transformers 5 maps DeepSeek-V3's
MLP names onto its fused routed experts and loads no MLP adapter (docs/lora.md)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import convert_checkpoint
from scripts import generate as generate_script
from tests.helpers import TINY_RUN, run_train
from torchtitan.checkpoint import lora_export
from torchtitan.checkpoint.folders import Manifest
from torchtitan.checkpoint.model_args import checkpoint_args
from torchtitan.checkpoint.weights import load_model_entries, write_weights
from torchtitan.config.manager import parse_args
from torchtitan.models import get_train_spec
from torchtitan.parallelisms.lora import apply_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The parity suite's scale and learning rate, so that 3 steps move the logits well beyond the tolerance.
LORA = ["--lora.rank", "8", "--lora.alpha", "32", "--optimizer.lr", "1e-2"]
FAMILIES = {
    "llama3": ("tiny", "all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3": ("tiny", "all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "deepseek_v3": ("tiny", "attention.*", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
}
TOLERANCE = 1e-4


def our_adapted_model(seed: str, ckpt: str, name: str, flavor: str) -> torch.nn.Module:
    """Our model with the checkpoint's adapters beside the seed's base, in one process."""
    record = Manifest.read(ckpt).lora
    config = parse_args(["--model.name", name, "--model.flavor", flavor, "--checkpoint.initial_load_path", seed,
                         "--lora.rank", str(record["rank"]), "--lora.alpha", str(record["alpha"]),
                         "--lora.target_modules", ",".join(record["target_modules"])])
    spec = get_train_spec(name)
    model = spec.model_cls.from_model_args(checkpoint_args(spec.config, flavor, Manifest.read(seed).model_args))
    apply_lora(model, config.lora)
    missing, unexpected = model.load_state_dict({**load_model_entries(seed), **lora_export.adapter_entries(ckpt)},
                                                strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("rope_cache")], (missing, unexpected)
    return model.eval()


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def hf_model(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_merged_and_peft_exports_compute_our_adapted_model(name, tmp_path, capsys):
    flavor, targets, modules = FAMILIES[name]
    family = [*TINY_RUN, "--model.name", name, "--model.flavor", flavor]
    run_train([*family, "--job.dump_folder", str(tmp_path / "seed"), "--checkpoint.create_seed_checkpoint"])
    seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
    run_train([*family, *LORA, "--lora.target_modules", targets, "--training.steps", "3", "--checkpoint.enable_checkpoint",
               "--checkpoint.initial_load_path", seed, "--job.dump_folder", str(tmp_path / "run")])
    ckpt = str(tmp_path / "run" / "checkpoint" / "step-3")
    for args in (["dcp-to-hf", seed, tmp_path / "base_hf"], ["dcp-to-hf", "--lora-merge", ckpt, tmp_path / "merged"],
                 ["lora-to-peft", ckpt, tmp_path / "peft"]):
        assert convert_checkpoint.main([str(a) for a in args]) == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "peft" / lora_export.PEFT_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 32.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(modules)

    ours = our_adapted_model(seed, ckpt, name, flavor)
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    adapted, base = logits(ours, tokens), logits(hf_model(tmp_path / "base_hf"), tokens)
    with_peft = peft.PeftModel.from_pretrained(hf_model(tmp_path / "base_hf"), str(tmp_path / "peft")).eval()
    peft_logits = logits(with_peft, tokens)
    peft_merged = logits(with_peft.merge_and_unload().eval(), tokens)
    merged = logits(hf_model(tmp_path / "merged"), tokens)
    diffs = {"adapters vs base": (adapted - base).abs().max().item(),
             "ours vs peft": (adapted - peft_logits).abs().max().item(),
             "peft merged vs our merged": (peft_merged - merged).abs().max().item(),
             "ours vs our merged": (adapted - merged).abs().max().item()}
    if name == "llama3":  # generation reads the LoRA checkpoint itself: its base (the run's) with the adapters
        source = generate_script.find_source(ckpt)
        diffs["generate.py vs ours"] = (logits(generate_script.build_model(source, 16, torch.device("cpu"),
                                                                           torch.float32), tokens) - adapted).abs().max().item()
    print(f"{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert diffs["adapters vs base"] > 100 * TOLERANCE  # the adapters trained: the comparisons below mean something
    assert max(v for k, v in diffs.items() if k != "adapters vs base") <= TOLERANCE, diffs


def test_exports_refuse_with_one_line(tmp_path, capsys):
    """A checkpoint without LoRA given to lora-to-peft, a LoRA checkpoint without --lora-merge, a base
    that is not there or is another model, a LoRA record without adapters; nothing is written. A
    base given as a Hugging Face folder merges as its checkpoint does."""
    def refused(args: list, expected: str) -> None:
        status, err = convert_checkpoint.main([str(a) for a in args]), capsys.readouterr().err
        assert status == 2 and err.strip().count("\n") == 0 and expected in err, err

    seeds = {}
    for flavor in ("tiny", "debugmodel"):
        run_train([*TINY_RUN, "--model.flavor", flavor, "--job.dump_folder", str(tmp_path / flavor),
                   "--checkpoint.create_seed_checkpoint"])
        seeds[flavor] = tmp_path / flavor / "checkpoint" / "step-0"
    refused(["lora-to-peft", seeds["tiny"], tmp_path / "out"], "holds no LoRA adapters")
    run = tmp_path / "run"
    run_train([*TINY_RUN, *LORA, "--training.steps", "2", "--checkpoint.enable_checkpoint", "--checkpoint.initial_load_path",
               str(seeds["tiny"]), "--job.dump_folder", str(run)])
    ckpt = run / "checkpoint" / "step-2"
    refused(["dcp-to-hf", ckpt, tmp_path / "out"], "add --lora-merge")
    refused(["dcp-to-hf", "--lora-merge", "--base", tmp_path / "nowhere", ckpt, tmp_path / "out"],
            "nowhere does not exist; name the base model")
    refused(["dcp-to-hf", "--lora-merge", "--base", seeds["debugmodel"], ckpt, tmp_path / "out"],
            "does not fit its adapters: layers.0.attention.wq.weight is [256, 256] there, the adapters make [128, 128]")
    manifest = Manifest.read(str(seeds["tiny"]))
    manifest.lora = Manifest.read(str(ckpt)).lora
    write_weights(load_model_entries(str(seeds["tiny"])), str(tmp_path / "no_adapters"), manifest)
    refused(["lora-to-peft", tmp_path / "no_adapters", tmp_path / "out"], "records LoRA but holds no adapter weights")
    assert not (tmp_path / "out").exists()
    for args in (["dcp-to-hf", seeds["tiny"], tmp_path / "base_hf"],
                 ["dcp-to-hf", "--lora-merge", ckpt, tmp_path / "merged"],
                 ["dcp-to-hf", "--lora-merge", "--base", tmp_path / "base_hf", ckpt, tmp_path / "merged_from_hf"]):
        assert convert_checkpoint.main([str(a) for a in args]) == 0, capsys.readouterr().err
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == \
        (tmp_path / "merged_from_hf" / "model.safetensors").read_bytes()
