"""scripts/gpu_paths.py (the GPU paths check): its --dry path end to end on CPU, every check run
with tiny stand-ins and its figures parsed; and that a failing check fails the report."""

from __future__ import annotations

import json
import math

import pytest

from scripts import gpu_paths
from tests.helpers import passing_dry_report, trainer_runs_on_the_warm_launcher


@pytest.mark.budget("every check of the GPU paths check on CPU stand-ins: 13 trainer runs, two at a time (~20 s)")
def test_dry_run_runs_every_check_and_parses_its_figures(tmp_path, monkeypatch, capsys):
    """In-process, with the trainer runs forked from the suite's warm launcher (the script's own
    runner starts `python -m torchtitan.train`, the same trainer, 3 s of imports each)."""
    trainer_runs_on_the_warm_launcher(monkeypatch, gpu_paths.base)
    report = passing_dry_report(gpu_paths.main, tmp_path, capsys, "gpu_paths --dry (all)")
    assert list(report["checks"]) == list(gpu_paths.PARTS["all"])  # in priority order
    for name, check in report["checks"].items():
        assert check["status"] == "ok", (name, check)
        if name != "step_agreement_2_ranks":
            assert check["tokens_per_second"] > 0 and check["memory_peak_gib"] > 0, name
            assert math.isfinite(check["loss_first"]) and math.isfinite(check["loss_last"]), name
            assert check["seq_len"] == gpu_paths.DRY.seq_len and check["compile"] is False, name
    checks = report["checks"]
    for name in ("train_8b", "train_3b_2x8k"):
        assert checks[name]["estimated_peak_gib"] > 0 and checks[name]["estimate_error_percent"] is not None
        assert checks[name]["activation_checkpoint"] == "selective"
    assert "--optimizer.state_dtype bfloat16" in checks["train_8b"]["command"]
    for name in ("float8_rowwise_8b", "float8_rowwise_3b_2x8k", "float8_tensorwise_3b_2x8k"):
        assert checks[name]["speedup_vs_bf16"] > 0 and checks[name]["applied"]["float8"]["linears"] > 0
    assert checks["float8_rowwise_8b"]["applied"]["float8"]["scaling"] == "rowwise"
    assert checks["float8_tensorwise_3b_2x8k"]["applied"]["float8"]["scaling"] == "tensorwise"
    profile = checks["train_3b_2x8k"]
    assert profile["profile"]["step_ms"] > 0 and 1 <= len(profile["largest_other"]) <= 3
    assert profile["steps_averaged"] == gpu_paths.DRY.steps - gpu_paths.DRY.left_out - 1  # the profiled step left out
    agreement = checks["step_agreement_2_ranks"]
    assert [r["rank"] for r in agreement["ranks"]] == [0, 1] and agreement["backend"] == "gloo"
    assert "--moe.capacity_factor 1.25" in checks["dsv3_compiled_capacity"]["command"]
    assert "--training.document_mask" in checks["flex_docmask_compiled"]["command"]


def test_a_failing_check_fails_the_report(tmp_path, monkeypatch, capsys):
    """A run that fails, or a check that breaks, is `failed` with its reason; the others still run;
    the exit status is 1. A probe that breaks fails every check, in a report that says why."""
    def train(name, args, *rest):
        if name == "chunked_loss_compiled":
            return {"status": "failed", "reason": "exit code 1: CUDA error: out of memory", "seconds": 1.0}
        if name == "flex_docmask_compiled":
            raise RuntimeError("the trainer runner broke")
        return {"status": "ok", "reason": None, "seconds": 1.0, "tokens_per_second": 10.0, "memory_peak_gib": 1.0}

    monkeypatch.setattr(gpu_paths.base, "train", train)
    out = tmp_path / "report.json"
    only = ["--only", "chunked_loss_compiled", "flex_docmask_compiled", "offload_pinned"]
    code = gpu_paths.main(["--dry", "--part", "paths", *only, "--out", str(out), "--work-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    assert code == 1 and report["ok"] is False
    assert report["checks"]["chunked_loss_compiled"]["status"] == "failed"
    assert report["checks"]["flex_docmask_compiled"] == {"status": "failed", "seconds": 0.0,
                                                         "reason": "RuntimeError: the trainer runner broke"}
    assert report["checks"]["offload_pinned"]["status"] == "ok"
    assert "chunked_loss_compiled        failed   - exit code 1: CUDA error: out of memory" in capsys.readouterr().out

    def broken_probe(*args):
        raise RuntimeError("the device probe failed: exit code 1")

    monkeypatch.setattr(gpu_paths, "probe", broken_probe)
    assert gpu_paths.main(["--dry", "--part", "paths", *only, "--out", str(out), "--work-dir", str(tmp_path)]) == 1
    report = json.loads(out.read_text())
    assert report["error"] == "RuntimeError: the device probe failed: exit code 1"
    assert {c["reason"] for c in report["checks"].values()} == {"not run (an earlier error)"}


def test_a_rank_that_cannot_join_or_answer_fails_the_agreement(monkeypatch):
    """A rank that cannot join its process group answers with the error; ranks that never answer
    within the timeout are reported as such."""
    import queue
    import socket

    answers: queue.Queue = queue.Queue()
    with socket.socket() as taken:  # rank 0 must serve the store on a port another socket holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gpu_paths._agreement_rank(0, taken.getsockname()[1], "cpu", answers)
    answer = answers.get_nowait()
    assert answer["rank"] == 0 and answer["error"].split(":")[0] in ("RuntimeError", "DistNetworkError")
    verdict = gpu_paths.step_agreement("cpu", timeout=0.01)  # the spawned ranks cannot answer that fast
    assert verdict["status"] == "failed" and "did not answer within 0s" in verdict["reason"]


def test_the_step_agreement_verdict_names_a_disagreeing_rank():
    good = {"stop_signal": 15, "nonfinite": True, "saves_done": False, "found_inf": 1.0, "pinned": True, "event": True}
    assert gpu_paths.agreement_verdict([{"rank": 0, **good}, {"rank": 1, **good}], "cuda")["status"] == "ok"
    verdict = gpu_paths.agreement_verdict([{"rank": 0, **good}, {"rank": 1, **good, "nonfinite": False,
                                                                 "pinned": False}], "cuda")
    assert verdict["status"] == "failed"
    assert verdict["reason"] == "rank 1 nonfinite=False; rank 1 copy not pinned or no event"
    refused = gpu_paths.agreement_verdict([{"rank": 0, "error": "RuntimeError: no CUDA support in gloo"}], "cuda")
    assert refused["reason"] == "cannot run two ranks on this device with gloo: RuntimeError: no CUDA support in gloo"


def test_checkpointing_follows_the_estimate():
    GiB = gpu_paths.GiB
    sel, full = {"peak_bytes": 100 * GiB}, {"peak_bytes": 90 * GiB}
    assert gpu_paths.choose_ac({"selective": sel, "full": full}, 120 * GiB) == ("selective", None)
    ac, note = gpu_paths.choose_ac({"selective": sel, "full": full}, 95 * GiB)
    assert ac == "full" and note.startswith("selective checkpointing is estimated at 100.0 GiB, more than the 95.0")
    ac, note = gpu_paths.choose_ac({"selective": sel, "full": full}, 70 * GiB)  # an 80 GB GPU and the 8B model
    assert ac is None and note == "does not fit: estimated at 90.0 GiB with full checkpointing, more than the 70.0 GiB usable here"
    assert gpu_paths.choose_ac({"selective": None, "full": None}, 120 * GiB)[0] == "full"
    result = gpu_paths.with_estimate({"memory_peak_gib": 100.0}, {"peak_bytes": 95 * GiB, "seconds": 3}, None)
    assert result["estimate_error_percent"] == -5.0 and result["estimated_peak_gib"] == 95.0
