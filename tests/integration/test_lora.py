"""LoRA runs beyond the parity suite's losses (torchtitan/tools/parity_layouts.py, "lora"; docs/lora.md):
the adapters' initial values matter to the losses (so equal losses across layouts show equal
initial values), an adapters-only checkpoint holds the adapters alone and resumes bitwise from its
base, and the frozen base comes out of training bitwise as it went in. The runs are the parity
suite's, shared with tests/integration/test_parity.py through the session's harness."""

from __future__ import annotations

import torch

from torchtitan.checkpoint.folders import Manifest
from torchtitan.checkpoint.weights import load_model_entries
from torchtitan.parallelisms.lora_linear import is_adapter_name
from torchtitan.tools.parity_layouts import LORA, LORA_TINY_TRAINABLE, all_layouts


def test_the_adapters_initial_values_move_the_losses(parity):
    """Adapters drawn from another seed end far beyond the parity tolerance from the LoRA baseline,
    and LoRA far from full fine-tuning: equal losses across layouts mean equal adapters, trained
    alone."""
    lora = tuple(LORA.split())
    base, other = parity.baseline(lora, ()), parity.baseline((*lora, "--training.seed", "1"), ())
    full = parity.baseline(("--optimizer.lr", "1e-2"))  # every weight trained, at the same learning rate
    seeds = [abs(a - b) for a, b in zip(base.losses, other.losses)]
    seeds += [abs(a["loss"] - b["loss"]) for a, b in zip(base.validations, other.validations)]
    print(f"adapters of seed 0 vs 1: max |loss diff| {max(seeds):.2e}; LoRA vs full fine-tuning "
          f"{max(abs(a - b) for a, b in zip(base.losses, full.losses)):.2e}")
    assert base.losses[0] == other.losses[0] == full.losses[0]  # B starts at zero: the base's own loss
    assert max(seeds) > 10 * parity.loss_tolerance
    assert max(abs(a - b) for a, b in zip(base.losses, full.losses)) > 10 * parity.loss_tolerance
    assert base.setup["lora"]["trainable_parameters"] == LORA_TINY_TRAINABLE


def test_an_adapters_only_checkpoint_resumes_bitwise(parity):
    """FSDP 2's run saves at steps 3 and 6 with the adapters alone; started again from step 3 (its
    base read from checkpoint.initial_load_path again) it repeats steps 4-6 bit for bit."""
    layout = all_layouts()["lora_fsdp2"]
    parity.run(layout)
    step = parity.workdir / layout.name / "checkpoint" / "step-6"
    manifest = Manifest.read(str(step))
    assert manifest.lora["adapters_only"] and manifest.lora["base"] == str(parity.seed_checkpoint().resolve())
    model = load_model_entries(str(step))
    assert model and all(is_adapter_name(k) for k in model), sorted(model)[:3]
    assert manifest.total_bytes < Manifest.read(str(parity.seed_checkpoint())).total_bytes
    uninterrupted, resumed = parity.resume(layout, 3)
    assert resumed == uninterrupted


def test_the_frozen_base_comes_out_bitwise_unchanged(parity):
    """TP 2 saves the whole model at its last step: every base weight is the seed's, bit for bit, and
    every adapter B has moved from zero."""
    layout = all_layouts()["lora_tp2"]
    parity.run(layout)
    trained = load_model_entries(str(parity.workdir / layout.name / "checkpoint" / f"step-{parity.steps}"))
    seed = load_model_entries(str(parity.seed_checkpoint()))
    base = {k: v for k, v in trained.items() if not is_adapter_name(k)}
    assert set(base) == set(seed)
    changed = [k for k in seed if not torch.equal(base[k], seed[k])]
    assert changed == []
    b = [v for k, v in trained.items() if k.endswith("lora_b.weight")]
    assert len(b) == 14 and all(v.any() for v in b)


def test_a_full_checkpoint_or_a_hugging_face_folder_is_a_base(tmp_path):
    """checkpoint.initial_load_path may name a full checkpoint of a run without LoRA (model, optimizer,
    data: its weights are read) or a Hugging Face folder; the fresh adapters leave the first step's
    loss exactly the base's."""
    from scripts import convert_checkpoint
    from tests.helpers import TINY_RUN, losses, read_setup, run_train

    run_train([*TINY_RUN, "--training.steps", "2", "--checkpoint.enable_checkpoint", "--job.dump_folder",
               str(tmp_path / "full")])
    step2 = tmp_path / "full" / "checkpoint" / "step-2"
    assert convert_checkpoint.main(["dcp-to-hf", str(step2), str(tmp_path / "hf")]) == 0
    first = {}
    for name, base, lora in (("plain", step2, ()), ("lora", step2, LORA.split()), ("lora_hf", tmp_path / "hf", LORA.split())):
        run_train([*TINY_RUN, "--training.steps", "2", "--checkpoint.initial_load_path", str(base), *lora,
                   "--job.dump_folder", str(tmp_path / name)])
        load = read_setup(tmp_path / name)["initial_load"]
        assert load["weights_only"] and load["path"] == str(base), load
        first[name] = losses(tmp_path / name)[0]
    assert first["lora"] == first["plain"]
    assert abs(first["lora_hf"] - first["plain"]) < 1e-5, first
