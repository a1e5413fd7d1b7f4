"""Parity of the hand-picked layouts (the harness's SUITES: options of one parallelism and float8;
the layouts themselves are the layout matrix's, test_layout_matrix.py): each trains like one
process (same seed checkpoint, same global batch and data order, deterministic fp32 on CPU):
per-step losses within 1e-4 and the final gradient norm within 1e-3 (relative) over 10 steps;
float8 layouts, whose activation scales depend on each rank's rows, within 1e-3 of a float8
baseline."""

import pytest

from torchtitan.tools.parity import SUITES, Layout, ParityError, all_layouts


@pytest.mark.parametrize("name", [layout.name for suite in SUITES.values() for layout in suite])
def test_layout_matches_single_process(parity, name):
    result = parity.check(all_layouts()[name])
    print(f"{name}: max |loss diff| {result.max_loss_diff:.3e}, final grad norm rel diff {result.grad_norm_rel_diff:.3e}")
    base = parity.baseline()
    assert [r["step"] for r in base.records] == list(range(1, 11))
    assert base.losses[-1] < base.losses[0], "the loss should fall over 10 steps"


def test_float8_all_gather_equals_the_high_precision_all_gather(parity):
    """FSDP's float8 all-gather casts each shard with the scale of the whole weight, so it must give
    exactly the float8 values that casting after a high-precision all-gather gives."""
    layouts = all_layouts()
    plain, float8_gather = parity.run(layouts["float8_fsdp2"]), parity.run(layouts["float8_fsdp2_float8_gather"])
    assert max(abs(a - b) for a, b in zip(plain.losses, float8_gather.losses)) <= 1e-6


def test_harness_catches_a_different_run(parity):
    """A run with another learning rate must fail the comparison: the harness can fail."""
    with pytest.raises(ParityError, match="max \\|loss diff\\|"):
        parity.check(Layout("other_lr", 1, ("--optimizer.lr", "1e-3")))


def test_harness_catches_an_unapplied_layout(parity):
    with pytest.raises(ParityError, match="was not applied"):
        parity.run(Layout("typo", 1, (), expect_log="applied FSDP"))
