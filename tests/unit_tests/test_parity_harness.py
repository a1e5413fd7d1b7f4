"""The parity harness's verdicts on a bad run (torchtitan/tools/parity.py), with a runner that trains
nothing (tests/machinery/fake_runner.py): a run not started from the seed, logged or validated steps
that differ from the baseline's, a grad norm outside the tolerance, a batch that does not divide.
What a real run gives is tested in tests/integration/test_parity.py."""

import pytest

from tests.machinery.fake_runner import FakeRunner
from torchtitan.errors import ConfigError
from torchtitan.tools.parity import Layout, ParityError, ParityHarness, local_batch_size

LAYOUT = Layout("fsdp2", 2, ("--training.data_parallel_shard_degree", "2"))


def harness(tmp_path, **change) -> ParityHarness:
    return ParityHarness(tmp_path, steps=3, runner=FakeRunner(change))


def test_the_fake_runs_pass_as_equal(tmp_path):
    c = harness(tmp_path).check(LAYOUT)
    assert c.max_loss_diff == 0 and c.grad_norm_rel_diff == 0 and len(c.loss_diffs) == 3


def test_a_run_not_started_from_the_seed_checkpoint_is_refused(tmp_path):
    no_setup = harness(tmp_path, fsdp2=lambda rows: rows[1:])
    with pytest.raises(ParityError, match=r"^fsdp2: the run did not start from the seed checkpoint \(initial_load: "
                                          r"no setup record\)$"):
        no_setup.run(LAYOUT)
    fresh = harness(tmp_path / "other", fsdp2=lambda rows: [{**rows[0], "initial_load": None}, *rows[1:]])
    with pytest.raises(ParityError, match=r"did not start from the seed checkpoint \(initial_load: None\)"):
        fresh.run(LAYOUT)


def test_steps_logged_apart_from_the_baseline_are_an_error(tmp_path):
    short = harness(tmp_path, fsdp2=lambda rows: [r for r in rows if r.get("step") != 3 or "record" in r])
    with pytest.raises(ParityError, match=r"^fsdp2: logged steps \[1, 2\] differ from the baseline's$"):
        short.compare(LAYOUT)


def test_steps_validated_apart_from_the_baseline_are_an_error(tmp_path):
    unvalidated = harness(tmp_path, fsdp2=lambda rows: [r for r in rows if r.get("record") != "validation"])
    with pytest.raises(ParityError, match=r"^fsdp2: validated at steps \[\], the baseline at \[3\]$"):
        unvalidated.compare(LAYOUT)


def test_a_final_grad_norm_outside_the_tolerance_fails_the_check(tmp_path):
    def larger_last_norm(rows):
        rows[3] = {**rows[3], "grad_norm": rows[3]["grad_norm"] * 1.01}
        return rows

    with pytest.raises(ParityError, match=r"^fsdp2: final grad norm differs by 1\.000e-02 \(relative\) > 0\.001$"):
        harness(tmp_path, fsdp2=larger_last_norm).check(LAYOUT)
    loose = Layout("fsdp2", 2, LAYOUT.overrides, grad_norm_rtol=0.02)
    assert harness(tmp_path / "loose", fsdp2=larger_last_norm).check(loose).grad_norm_rel_diff == pytest.approx(0.01)


def test_a_global_batch_the_layout_cannot_split_is_a_config_error():
    assert local_batch_size(8, ("--training.gradient_accumulation_steps", "2"), 2) == 2
    with pytest.raises(ConfigError, match="^global batch 8 does not divide by data-parallel degree x accumulation 3$"):
        local_batch_size(8, (), 3)


RESUMING = Layout("fsdp2_resume", 2, ("--training.data_parallel_shard_degree", "2", "--checkpoint.enable_checkpoint",
                                      "--checkpoint.interval", "1"))


def test_replica_groups_compare_their_mean_loss(tmp_path):
    """Two groups of 2 ranks (a lighthouse is started; the fake runner writes each group's folder):
    the groups' mean loss is compared, and groups that logged other steps are an error."""
    pytest.importorskip("torchft")
    groups = Layout("groups", 2, ("--training.data_parallel_shard_degree", "2"), replica_groups=2)
    lower = harness(tmp_path, replica_1=lambda rows: [{**r, "loss": r["loss"] - 0.5} if "loss" in r and "record" not in r
                                                       else r for r in rows])
    c = lower.compare(groups)
    assert c.max_loss_diff == pytest.approx(0.25) and c.run.nproc == 4
    short = harness(tmp_path / "short", replica_1=lambda rows: [r for r in rows if r.get("step") != 3 or "record" in r])
    with pytest.raises(ParityError, match=r"^the replica groups logged different steps: \[\[1, 2, 3\], \[1, 2\]\]$"):
        short.run(groups)


def test_a_resume_needs_the_checkpoint_and_must_resume_from_it(tmp_path):
    resumed = harness(tmp_path).resume(RESUMING, 2)
    assert resumed == ([9.7], [9.7])
    with pytest.raises(ParityError, match=r"^fsdp2: no checkpoint of step 2 in .* to resume from$"):
        harness(tmp_path / "none").resume(LAYOUT, 2)
    fresh = harness(tmp_path / "fresh", **{"fsdp2_resume-resumed-2": lambda rows: [
        {**rows[0], "initial_load": {"path": "seed", "weights_only": True, "step": 0}}, *rows[1:]]})
    with pytest.raises(ParityError, match=r"^fsdp2_resume: the second run did not resume from step 2"):
        fresh.resume(RESUMING, 2)
    short = harness(tmp_path / "short", **{"fsdp2_resume-resumed-2": lambda rows: rows[:1]})
    with pytest.raises(ParityError, match=r"^fsdp2_resume: the resumed run logged steps \[\], the uninterrupted one \[3\]$"):
        short.resume(RESUMING, 2)
