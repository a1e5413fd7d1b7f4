"""Training steps that never wait on the host (docs/performance.md, "Host reads"): with the audit on
(profiling.audit_host_reads), a steady-state step of a dense layout reads nothing on the host on
any rank; the ranks' agreement is read a step late, a background checkpoint save is published
through it, and a non-finite step found a step late is still never applied or saved. Every eager
layout of the layout matrix is audited too (tests/integration/test_layout_matrix.py)."""

import json

from tests.helpers import TINY_RUN, read_metrics, run_train

QUIET = ["--metrics.log_freq", "100", "--profiling.audit_host_reads"]  # only the first and last steps log


def reports(folder) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted((folder / "host_reads").glob("rank*.json"))]
    assert found, f"no audit in {folder}"
    return found


def test_steady_state_steps_read_nothing_and_a_background_save_is_published_a_step_late(tmp_path):
    run_train([*TINY_RUN, *QUIET, "--training.steps", "7", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "3",
               "--checkpoint.async_mode", "async", "--job.dump_folder", str(tmp_path)], nproc=2)
    for report in reports(tmp_path):
        assert report["steady_state"] == 0, report["steady_state_by_line"]
        reads = report["reads"]
        # Steps 2, 4 and 5 neither log, save nor validate: nothing on them waits on the device.
        assert [r for r in reads if r["step"] in (2, 4, 5) and not r["deferred"] and not r["scheduled"]] == []
        # A quiet step's agreement is read during the next step; one that logs or saves (1, 3, 6, 7)
        # reads its own at once. So steps 3, 5 and 6 read those of 2, 4 and 5.
        assert sorted(r["step"] for r in reads if r["deferred"]) == [3, 5, 6]
    manifests = sorted(p.parent.name for p in (tmp_path / "checkpoint").glob("step-*/manifest.json"))
    assert manifests == ["step-3", "step-6", "step-7"]  # each background save published, none left behind
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 7]


def test_a_nonfinite_step_found_a_step_late_is_never_applied_or_saved(tmp_path):
    args = [*TINY_RUN, *QUIET, "--training.steps", "6", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
            "--experimental.custom_import", "tests.faults.checkpoint", "--model.name", "llama3_nan",
            "--job.dump_folder", str(tmp_path)]
    # Step 3 neither logs nor saves: its agreement is read during step 4, before step 4's update;
    # the fused optimizer skipped step 3's update on the device meanwhile.
    result = run_train(args, extra_env={"TT_NAN_FROM_STEP": "3"}, check=False)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: non-finite loss at step 3 (loss nan, gradient norm nan); the step was not applied; lower optimizer.lr "
        f"or raise training.warmup_steps, then resume; newest checkpoint: {tmp_path / 'checkpoint' / 'step-2'}"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
    (report,) = reports(tmp_path)
    assert [(r["step"], r["phase"]) for r in report["reads"] if r["deferred"]] == [(4, "agreeing to go on")]
