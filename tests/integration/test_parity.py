"""Parity of the hand-picked layouts (the harness's SUITES: options of one parallelism and float8;
the layouts themselves are the layout matrix's, test_layout_matrix.py, and so are the layouts in
MATRIX_PROVES that its CI points train too): each trains like one
process (same seed checkpoint, same global batch and data order, deterministic fp32 on CPU):
per-step losses within 1e-4 and the final gradient norm within 1e-3 (relative) over 6 steps (10 with scripts/loss_compare.py);
float8 layouts, whose activation scales depend on each rank's rows, within 1e-3 of a float8
baseline; bf16 layouts within parity_layouts.BF16_TOLERANCES of one process computing in bf16 too."""

import pytest

from tests.machinery.layout_matrix import ci_points
from torchtitan.tools.parity import Layout, ParityError
from torchtitan.tools.parity_layouts import DOCUMENT_MASK, QWEN3_MOE_CAPACITY, SUITES, all_layouts

# Hand-picked layouts whose feature and dims the layout matrix's CI points train too (the same
# factor values beside the same dims, against one process of the same numerics): CI runs them
# there, once, and these only with scripts/loss_compare.py (every suite). Each entry: the factor
# values and the dims a trained CI point of the matrix must hold for the layout to be left out.
MATRIX_PROVES = {
    "muon_fsdp2": ({"optimizer": "muon"}, ("dp_shard",)),
    "muon_tp2": ({"optimizer": "muon"}, ("tp",)),
    "muon_pp2": ({"optimizer": "muon"}, ("pp",)),
    "muon_moe_ep2": ({"optimizer": "muon", "model": "moe"}, ("ep",)),
    "muon_hsdp_zero1": ({"optimizer": "muon", "zero1": "on"}, ("dp_shard",)),
    "docmask_tp2_sp_ac_op": ({"docmask": "on", "ac": "op"}, ("tp",)),
    "docmask_pp2_interleaved": ({"docmask": "on", "schedule": "interleaved"}, ("pp",)),
    "docmask_cp2_compile": ({"docmask": "on", "compile": "on"}, ("cp",)),
    "docmask_cp2_fsdp2_allgather": ({"docmask": "on", "cp_method": "allgather"}, ("cp", "dp_shard")),
    "docmask_cp2_tp2": ({"docmask": "on"}, ("cp", "tp")),
    "docmask_cp2_pp2_allgather": ({"docmask": "on", "cp_method": "allgather"}, ("cp", "pp")),
    "chunked_loss_pp2": ({"chunked": "on"}, ("pp",)),
    "float8_tp2": ({"float8": "on", "sp": "off"}, ("tp",)),
    "moe_ep2": ({"model": "moe"}, ("ep",)),
    "moe_ep2_fsdp4": ({"model": "moe"}, ("ep", "dp_replicate")),
    "moe_ep2_tp2": ({"model": "moe"}, ("ep", "tp")),
    "moe_ep2_pp2": ({"model": "moe"}, ("ep", "pp")),
    "moe_ep2_cp2": ({"model": "moe"}, ("ep", "cp")),
    "dsv3_ep2": ({"model": "dsv3"}, ("ep",)),
    "dsv3_ep2_tp2": ({"model": "dsv3"}, ("ep", "tp")),
    "dsv3_tp2_no_sp": ({"model": "dsv3", "sp": "off"}, ("tp",)),
    "dsv3_cp2": ({"model": "dsv3", "mtp": "on", "ac": "full"}, ("cp",)),
    "dsv3_fsdp2_no_mtp": ({"model": "dsv3", "mtp": "off"}, ("dp_shard",)),
}


def proven_by_the_matrix() -> set[str]:
    trained = [p for p in ci_points() if not p.refused_by_design]
    return {name for name, (values, dims) in MATRIX_PROVES.items()
            if any(all(p.value(f) == v for f, v in values.items()) and set(dims) <= set(p.active_dims) for p in trained)}


PROVEN = proven_by_the_matrix()
# Layouts of the SFT and LoRA suites beyond the ones the proof names, run by
# scripts/loss_compare.py (--suite sft, --suite lora) and recorded in docs/fine_tuning.md and
# docs/lora.md: their families' paths are proven in CI by the exports against transformers and peft
# (test_lora_export.py) and the SFT batches are family-independent (the same rows feed every model).
LOSS_COMPARE_ONLY = {"sft_dsv3_tp2", "lora_dsv3_tp2", "lora_qwen3_moe_tp2",
                     # 90 s of inductor on 2 cores: its compiled parts against eager are
                     # test_compile_coverage.py's, in this process.
                     "moe_capacity_ep2_compile"}
# The fast tier's layouts: an FSDP option, float8, bf16, document masking, the Qwen3 MoE family and
# DeepSeek-V3 (latent attention split by heads, MTP under loss parallelism, experts over the tp ranks),
# those the matrix's CI points do not train already.
FAST = ("fsdp2_cpu_offload", "float8_fsdp2", "bf16_tp2", "docmask_tp2_sp_ac_op", "moe_ep2", "dsv3_ep2_tp2")
# Suites CI runs over 10 steps, as scripts/loss_compare.py does (test_ten_step_layout_matches_single_process).
TEN_STEPS = ("gpt_oss",)


@pytest.mark.unmeasured("numerics only: trains and compares losses; the harness's verdicts are test_parity_harness.py's")
@pytest.mark.parametrize("name", [pytest.param(layout.name, marks=pytest.mark.fast) if layout.name in FAST else layout.name
                                  for suite_name, suite in SUITES.items() for layout in suite
                                  if layout.name not in PROVEN and layout.name not in LOSS_COMPARE_ONLY
                                  and suite_name not in TEN_STEPS])
def test_layout_matches_single_process(parity, name):
    result = parity.check(all_layouts()[name])
    print(f"{name}: max |loss diff| {result.max_loss_diff:.3e}, final grad norm rel diff {result.grad_norm_rel_diff:.3e}")
    base = parity.baseline()
    assert [r["step"] for r in base.records] == list(range(1, parity.steps + 1))
    first, last = base.validations[0]["loss"], base.validations[-1]["loss"]
    assert last < first, "the held-out loss should fall between the first and the last validation"


@pytest.mark.unmeasured("numerics only: trains and compares losses; the harness's verdicts are test_parity_harness.py's")
@pytest.mark.parametrize("name", [layout.name for suite in TEN_STEPS for layout in SUITES[suite]])
def test_ten_step_layout_matches_single_process(parity_10_steps, name):
    """gpt-oss (issue 56) under FSDP, TP, EP, PP, CP (its window of 8 shorter than each rank's 32
    positions) and EP x TP: per-step losses within 1e-4 of one process over 10 steps."""
    result = parity_10_steps.check(all_layouts()[name])
    print(f"{name}: max |loss diff| {result.max_loss_diff:.3e}, final grad norm rel diff {result.grad_norm_rel_diff:.3e}")
    assert [r["step"] for r in parity_10_steps.baseline(all_layouts()[name].shared).records] == list(range(1, 11))


def test_float8_all_gather_equals_the_high_precision_all_gather(parity):
    """FSDP's float8 all-gather casts each shard with the scale of the whole weight, so it must give
    exactly the float8 values that casting after a high-precision all-gather gives."""
    layouts = all_layouts()
    plain, float8_gather = parity.run(layouts["float8_fsdp2"]), parity.run(layouts["float8_fsdp2_float8_gather"])
    assert max(abs(a - b) for a, b in zip(plain.losses, float8_gather.losses)) <= 1e-6


def test_document_mask_changes_the_losses(parity):
    """The masked baseline (the document_mask suite's reference) must differ from the unmasked one
    by far more than the parity tolerance: the mask is really applied, so each masked layout's
    parity shows that the layout masks as one process does."""
    masked, plain = parity.baseline((DOCUMENT_MASK,)), parity.baseline()
    diffs = [abs(a - b) for a, b in zip(masked.losses, plain.losses)]
    validation_diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(masked.validations, plain.validations)]
    print(f"document mask vs none: per-step |loss diff| {[f'{d:.1e}' for d in diffs]}, "
          f"validation {[f'{d:.1e}' for d in validation_diffs]}")
    assert len(diffs) == parity.steps and len(validation_diffs) == 2
    # Over what a parity comparison compares: the training and the validation losses.
    assert max(diffs + validation_diffs) > 10 * parity.loss_tolerance, (diffs, validation_diffs)


def test_the_capacity_layout_really_drops_tokens(parity):
    """The dropping mode's parity row means something only if tokens were dropped: in every step of
    the layout and of its baseline; and from the same weights (step 1) the same pairs in every layer
    (capacity per sequence, whatever the layout). The losses alone would not show a capacity per
    rank batch: at init the tiny model's MoE outputs are small beside the residual, and a per-batch
    capacity moves its losses by less than the tolerance while dropping 94 pairs instead of 70."""
    run, base = parity.run(all_layouts()["moe_capacity_ep2_accum2"]), parity.baseline(tuple(QWEN3_MOE_CAPACITY.split()))
    for records in (run.records, base.records):
        dropped = [sum(v for k, v in r.items() if k.startswith("moe_dropped_tokens/")) for r in records]
        assert all(d > 0 for d in dropped), dropped
    first_run, first_base = ({k: v for k, v in r.items() if k.startswith("moe_dropped_tokens/")}
                             for r in (run.records[0], base.records[0]))
    assert first_run == first_base and len(first_base) == 2


@pytest.mark.fast
def test_harness_catches_a_different_run(parity):
    """A run with another learning rate must fail the comparison: the harness can fail."""
    with pytest.raises(ParityError, match="max \\|loss diff\\|"):
        parity.check(Layout("other_lr", 1, ("--optimizer.lr", "1e-3")))


@pytest.mark.fast
def test_harness_catches_an_unapplied_layout(parity):
    """A run whose setup record lacks what the layout declares (here: no FSDP on one process)."""
    with pytest.raises(ParityError, match=r"was not applied: fsdp.mesh should be \{'dp_shard_cp': 2\}, the run "
                                          "recorded nothing"):
        parity.run(Layout("typo", 1, (), expect=(("fsdp.mesh", {"dp_shard_cp": 2}),)))


def test_the_records_say_what_each_run_applied_and_loaded(parity):
    """The setup record of an FSDP 2 run and of a pipeline run: the values every other test reads."""
    layouts = all_layouts()
    fsdp = parity.run(layouts["fsdp2_reshard_never"]).setup
    assert fsdp["world_size"] == 2 and fsdp["mesh"] == {"dp_shard": 2} and fsdp["first_step"] == 1
    assert fsdp["fsdp"] == {"modules": 3, "mesh": {"dp_shard_cp": 2}, "reshard_after_forward": "never",
                            "cpu_offload": False, "param_dtype": "float32", "reduce_dtype": "float32"}
    assert fsdp["ddp"] is fsdp["tp"] is fsdp["pipeline"] is fsdp["zero1"] is fsdp["float8"] is None
    assert fsdp["initial_load"] == {"path": str(parity.seed_checkpoint()), "weights_only": True, "step": 0}
    # llama3 tiny: 2 blocks of width 128 (q and o 128 x 128, k and v 128 x 64, a 512-wide SwiGLU, 2
    # norms), a 2,256-row embedding and output, and the final norm.
    params = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512 + 2 * 128) + 2 * 2256 * 128 + 128
    assert fsdp["model"] == {"name": "llama3", "flavor": "tiny", "parameters": params, "vocab_size": 2256,
                             "vocab_padding": 0}
    # Every rank's share: each holds half of the parameters and of the optimizer state.
    whole = parity.baseline().setup["ranks"]
    assert [r["rank"] for r in fsdp["ranks"]] == [0, 1] and len(whole) == 1
    for r in fsdp["ranks"]:
        assert r["parameter_bytes"] == whole[0]["parameter_bytes"] // 2
        assert r["optimizer_state_bytes"] == whole[0]["optimizer_state_bytes"] // 2
    pp = parity.run(layouts["pp2_csv_1f1b"]).setup
    assert pp["pipeline"] == {"schedule": "CSV", "microbatches": 2, "stages": 2, "split_points": ["layers.1"]}
    assert [r["pipeline_stages"] for r in pp["ranks"]] == [
        [{"stage": 0, "blocks": ["layers.0"]}], [{"stage": 1, "blocks": ["layers.1"]}]]
    assert pp["activation_checkpoint"] == {"blocks": ["layers.0"], "wrapped": [],
                                           "op_level": False, "offloaded": []}


def test_every_layout_left_to_the_matrix_exists_and_is_proven_there():
    """MATRIX_PROVES names real layouts, and its specs name real factor values and dims."""
    from tests.machinery.matrix_space import ALL_DIMS, FACTOR

    assert set(MATRIX_PROVES) <= set(all_layouts())
    for values, dims in MATRIX_PROVES.values():
        assert all(v in FACTOR[f].values for f, v in values.items()) and set(dims) <= set(ALL_DIMS)
    assert len(PROVEN) >= len(MATRIX_PROVES) // 2, sorted(set(MATRIX_PROVES) - PROVEN)
