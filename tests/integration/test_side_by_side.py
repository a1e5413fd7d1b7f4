"""scripts/side_by_side.py without its anchor (torchtitan from the package index, which CI does not
install): our side trains through the worker and reports, the orchestrator parses a stand-in
anchor's result line, computes the ratios, and reports a failed or different side as such."""

from __future__ import annotations

import json
import math
import stat
import sys
import time
from pathlib import Path

import pytest

from scripts import side_by_side
from scripts.side_by_side_worker import RESULT_PREFIX, SHAPES


def _stand_in_anchor(tmp_path, line: str, code: int = 0):
    """An "interpreter" that says it holds torchtitan 0.3.0 when asked (`-I -c ...`), and otherwise
    prints `line` and exits with `code`, as the anchor's worker would."""
    script = tmp_path / "anchor_python"
    script.write_text(f"#!/bin/sh\nif [ \"$2\" = -c ]; then echo 0.3.0; echo /anchor/torchtitan/__init__.py; exit 0; fi\n"
                      f"cat <<'END'\n{line}\nEND\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _anchor_result(**changes) -> dict:
    result = {"stack": "anchor", "attention": "sdpa", "shape": "debug", "seq": 64, "batch": 1, "steps": 2, "warmup": 1,
              "compile": False, "ac": "none", "float8": "none", "device": "cpu", "torch": "x", "dtype": "float32",
              "params": 6163712, "embedding_params": 524288, "tied": False, "flops_per_token": 36000000,
              "tokens_per_second": 1000.0, "tokens_per_cpu_second": 500.0, "step_seconds": [0.1, 0.1, 0.1],
              "first_loss": 8.1, "last_loss": 8.0, "memory_peak_gib": None, "rss_peak_gib": 0.5,
              "stack_version": "0.3.0"}
    return {**result, **changes}


@pytest.mark.fast
def test_our_side_trains_and_the_ratio_is_ours_over_the_anchors(monkeypatch):
    """Our worker trains the anchor's debug shape (the same parameter count as torchtitan 0.3.0's
    debugmodel, 6,163,712) in this process, and the ratio against an anchor's result is our
    tokens/s over the anchor's (how the worker is started, `python -I` apart, is the tests below)."""
    from scripts import side_by_side_worker
    from torchtitan.models import get_train_spec

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # the worker sets a one-rank job's; they go with the test
    # The flavor the worker registers for this process goes with the test too.
    monkeypatch.setitem(get_train_spec("llama3").config, "side_by_side_debug", None)
    ours = side_by_side_worker.run(side_by_side_worker.parse_args(
        ["--stack", "ours", "--shape", "debug", "--seq", "64", "--batch", "1", "--steps", "2", "--warmup", "1"]))
    assert ours["params"] == 6163712 and ours["shape"] == "debug" and ours["dtype"] == "float32"
    assert ours["tokens_per_second"] > 0 and ours["tokens_per_cpu_second"] > 0 and len(ours["step_seconds"]) == 3
    # An untrained model's loss over a 2,048-token vocabulary: about ln(2048) = 7.6.
    assert math.isfinite(ours["first_loss"]) and abs(ours["first_loss"] - math.log(SHAPES["debug"][3])) < 1.5
    row = side_by_side.summarise([_anchor_result(), ours], {("cpu", "float32"): (1e11, "given")})[0]
    assert row["tokens_per_second_ratio"] == pytest.approx(ours["tokens_per_second"] / 1000.0)
    assert row["tokens_per_cpu_second_ratio"] == pytest.approx(ours["tokens_per_cpu_second"] / 500.0)
    assert row["ours"]["tflops"] == pytest.approx(ours["tokens_per_second"] * ours["flops_per_token"] / 1e12)
    assert row["ours"]["mfu_percent"] == pytest.approx(100 * row["ours"]["tflops"] * 1e12 / 1e11)
    assert "| debug | ours / anchor | tokens per second" in side_by_side.table([row])


@pytest.mark.fast
def test_a_failed_side_is_reported_with_its_error_and_no_ratio(tmp_path):
    args = side_by_side.parse_args(["--anchor-python", _stand_in_anchor(
        tmp_path, "RuntimeError: Distributed package doesn't have NCCL built in", code=1)])
    failed = side_by_side.run_side("anchor", "debug", args, seed=0)
    assert failed == {"stack": "anchor", "shape": "debug",
                      "error": "exit 1: RuntimeError: Distributed package doesn't have NCCL built in"}
    ours = {**_anchor_result(stack="ours", tokens_per_second=2000.0)}
    rows = side_by_side.summarise([failed, ours])
    assert rows[0]["ratio_note"] == "a side did not run" and "tokens_per_second_ratio" not in rows[0]
    assert rows[0]["anchor"]["errors"] == [failed["error"]]
    assert "| debug | anchor | failed: exit 1: RuntimeError" in side_by_side.table(rows)
    # A line that is not the worker's result line is no result either.
    assert side_by_side.parse_result("step 1 loss 8.1\n") is None
    killed = side_by_side.parse_args(["--anchor-python", _stand_in_anchor(tmp_path, "x", code=0)])
    assert "exit 0: x" in side_by_side.run_side("anchor", "debug", killed, seed=0)["error"]


@pytest.mark.fast
def test_two_different_models_get_no_ratio():
    """A ratio is only between the same model: parameter counts must agree."""
    rows = side_by_side.summarise([_anchor_result(params=100), _anchor_result(stack="ours", params=101)])
    assert rows[0]["ratio_note"] == "not the same model: 101 parameters in ours, 100 in the anchor"
    rows = side_by_side.summarise([_anchor_result(memory_peak_gib=10.0, tokens_per_second=900.0),
                                   _anchor_result(stack="ours", memory_peak_gib=9.0, tokens_per_second=990.0)])
    assert rows[0]["tokens_per_second_ratio"] == pytest.approx(1.1) and rows[0]["memory_ratio"] == pytest.approx(0.9)


@pytest.mark.fast
def test_the_anchor_runs_isolated_from_this_repository():
    """`-I` keeps the repository and PYTHONPATH off the anchor's path; its own folders come first."""
    args = side_by_side.parse_args(["--shapes", "1B", "--anchor-python", "/anchor/python", "--anchor-site", "/a/site",
                                    "--compile", "--ac", "selective", "--float8", "rowwise"])
    args.untied = True
    cmd = side_by_side.worker_command("anchor", "1B", args, seed=3)
    assert cmd[:3] == ["/anchor/python", "-I", str(side_by_side.WORKER)]
    assert cmd[cmd.index("--site") + 1].split(":")[0] == "/a/site"
    for flag in ("--compile", "--untied"):
        assert flag in cmd
    assert cmd[cmd.index("--float8") + 1] == "rowwise" and cmd[cmd.index("--seed") + 1] == "3"
    ours = side_by_side.worker_command("ours", "1B", args, seed=3)
    assert ours[cmd.index("--site") + 1].split(":")[0] == str(side_by_side.REPO_ROOT)


@pytest.mark.fast
def test_without_an_anchor_it_says_how_to_get_one(tmp_path, capsys):
    """This repository's own `torchtitan` is no anchor: the harness refuses it in one line."""
    code = side_by_side.main(["--anchor-python", sys.executable, "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: no anchor to compare with: {sys.executable} finds no torchtitan release (")
    assert err.rstrip().endswith("run scripts/setup_anchor.sh, or give --anchor-python / --anchor-site")
    missing = tmp_path / "no_such_python"
    assert side_by_side.main(["--anchor-python", str(missing), "--out", str(tmp_path / "r.json")]) == 2
    assert f"{missing} finds no torchtitan release ([Errno 2] No such file or directory" in capsys.readouterr().err


@pytest.mark.fast
def test_arguments_that_measure_nothing_are_refused_and_a_budget_stops_new_runs(tmp_path, capsys):
    for bad in (["--steps", "0"], ["--rounds", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            side_by_side.parse_args(bad)
    assert "must be at least 1, got 0" in capsys.readouterr().err
    # Both sides stand-ins (no training): a short timeout without a budget still runs them; a budget
    # below a run's least time starts none.
    stand_in = _stand_in_anchor(tmp_path, RESULT_PREFIX + json.dumps(_anchor_result()))
    common = ["--rounds", "1", "--anchor-python", stand_in, "--ours-python", stand_in, "--timeout", "30"]
    assert side_by_side.main([*common, "--out", str(tmp_path / "a.json")]) == 0
    assert side_by_side.main([*common, "--budget-seconds", "5", "--out", str(tmp_path / "b.json")]) == 1
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    assert [r["error"] for r in runs] == ["not started: the time budget was spent"] * 2


@pytest.mark.fast
def test_a_side_that_hangs_is_stopped_with_what_it_started(tmp_path):
    """The worker leads its own process group: a timeout kills it and its children (compile workers)."""
    hang = tmp_path / "hanging_python"
    pid_file = tmp_path / "child.pid"
    hang.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    args = side_by_side.parse_args(["--anchor-python", str(hang)])
    assert side_by_side.run_side("anchor", "debug", args, seed=0, timeout=1) == {
        "stack": "anchor", "shape": "debug", "error": "timed out after 1 s"}
    stat_file = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # the grandchild is gone too (or a zombie: dead, waiting for init to reap it)
        if not stat_file.exists() or stat_file.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the hanging side's child outlived the timeout")


@pytest.mark.fast
def test_the_workers_version_is_none_without_a_distribution(monkeypatch):
    from importlib import metadata

    from scripts import side_by_side_worker

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert side_by_side_worker._dist_version() is None
