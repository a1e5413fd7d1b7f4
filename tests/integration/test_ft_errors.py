"""Fault tolerance's bad inputs through run_llama_train.sh, each one `error:` line and exit code 2:
the launcher's FT_LIGHTHOUSE variables (no torch started), a lighthouse nobody runs, two replica
groups launched with different options, and (exit code 5, a hang) a lighthouse gone mid-run
(docs/fault_tolerance.md). The option rules
themselves are tests/unit_tests/test_fault_tolerance_config.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import REPO_ROOT
from torchtitan.tools.replica_groups import lighthouse_binary

TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "3"]
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHFT_LIGHTHOUSE", "FT_LIGHTHOUSE")}
    return {**env, "NGPU": "1", "OMP_NUM_THREADS": "1", **extra}


def launch(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(["./run_llama_train.sh", *args], cwd=REPO_ROOT, env=environment(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: int = 120) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        process.kill()  # the launcher only; its torchrun and lighthouse end with it (their own timeouts)
    return process.returncode, out


def one_error(out: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    return errors[0]


@pytest.fixture
def torchft_hidden(tmp_path) -> dict[str, str]:
    """PYTHONPATH for processes in which torchft is not installed: a sitecustomize marks it missing,
    which both importlib.util.find_spec and `import torchft` honour."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.fast
def test_torchft_missing_is_one_line_in_the_launcher_and_its_precheck(tmp_path, torchft_hidden):
    code, out = finish(launch(["--job.dump_folder", str(tmp_path)], FT_LIGHTHOUSE="start", **torchft_hidden))
    assert code == 2 and "FT_LIGHTHOUSE needs torchft, an optional extra: pip install 'torchtitan[ft]'" in one_error(out)
    code, out = finish(launch([*FT, "--fault_tolerance.lighthouse", "localhost:1", "--job.dump_folder", str(tmp_path)],
                              **torchft_hidden))
    assert code == 2 and "fault_tolerance.enable needs torchft" in one_error(out)


@pytest.mark.parametrize("env,expected", [
    ({"FT_LIGHTHOUSE": "localhost"}, "FT_LIGHTHOUSE must be 'start' or the host:port of a running torchft lighthouse"),
    ({"FT_LIGHTHOUSE": "start", "FT_LIGHTHOUSE_PORT": "http"}, "FT_LIGHTHOUSE_PORT must be a port number"),
    ({"FT_LIGHTHOUSE": "start", "FT_MIN_REPLICAS": "0"}, "FT_MIN_REPLICAS must be the fewest replica groups"),
    ({"FT_LIGHTHOUSE": "start", "FT_LIGHTHOUSE_ARGS": "--no_such_option"},
     "FT_LIGHTHOUSE=start: the torchft lighthouse did not start on port"),
])
def test_launcher_refuses_bad_lighthouse_variables(tmp_path, env, expected):
    env = {"FT_LIGHTHOUSE_PORT": str(free_port()), **env}
    code, out = finish(launch([*FT, "--job.dump_folder", str(tmp_path)], **env))
    assert code == 2 and expected in one_error(out)


def test_launcher_refuses_a_lighthouse_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = finish(launch([*FT, "--job.dump_folder", str(tmp_path)], FT_LIGHTHOUSE="start",
                                  FT_LIGHTHOUSE_PORT=str(port)))
    assert code == 2 and f"port {port} is taken" in one_error(out) and f"FT_LIGHTHOUSE={socket.gethostname()}:" in out


@pytest.mark.budget("a launch that imports torch, then waits fault_tolerance.timeout_seconds (10-20 s on 2 cores)")
def test_unreachable_lighthouse_ends_within_the_timeout(tmp_path):
    """Nothing listens at the lighthouse's address: the group ends once fault_tolerance.timeout_seconds
    has passed, not later (the start-up before it takes ~10 s here)."""
    port = free_port()
    started = time.monotonic()
    code, out = finish(launch([*TINY, *FT, "--fault_tolerance.timeout_seconds", "2", "--job.dump_folder", str(tmp_path)],
                              FT_LIGHTHOUSE=f"localhost:{port}"))
    assert code == 2
    assert f"could not reach the lighthouse at localhost:{port} within 2 s" in one_error(out)
    assert time.monotonic() - started < 45


@pytest.mark.budget("two replica groups start, one starting the lighthouse and training alone until the other joins "
                    "(15-40 s on 2 cores)")
def test_groups_with_different_options_both_stop_with_one_line(tmp_path):
    """Group 0 starts the lighthouse (FT_LIGHTHOUSE=start) and trains alone (min_replica_size 1);
    group 1 joins it later with another learning rate, and, being behind, recovers from group 0 at
    its first step, taking no part in that step's average. Its configuration still reaches group 0:
    both stop with the one line, neither trains on. The lighthouse ends with group 0's launcher."""
    port = free_port()
    args = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "3000", "--metrics.log_freq", "1",
            *FT, "--fault_tolerance.timeout_seconds", "20", "--job.dump_folder", str(tmp_path)]
    first = launch([*args, "--fault_tolerance.replica_id", "0"], FT_LIGHTHOUSE="start", FT_LIGHTHOUSE_PORT=str(port))
    try:
        metrics = tmp_path / "replica_0" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        second = launch([*args, "--fault_tolerance.replica_id", "1", "--optimizer.lr", "0.002"],
                        FT_LIGHTHOUSE=f"localhost:{port}")
        results = [finish(second), finish(first)]
    finally:
        first.kill()
    for code, out in results:
        assert code == 2, out[-3000:]
        assert "the replica groups were started with different configurations (they differ in [optimizer]); " in one_error(out)
        assert "FutureWarning" not in out, out[-3000:]
    assert f"torchft lighthouse on {socket.gethostname()}:{port}" in results[1][1]
    assert not listening(port), "the started lighthouse outlived its launcher"


@pytest.mark.budget("one replica group trains until its lighthouse is killed, then waits out a 5 s quorum timeout")
def test_a_lighthouse_gone_mid_run_ends_the_group_naming_it(tmp_path):
    """The lighthouse dies mid-run: the group ends as a hang (exit 5) once no quorum formed within
    fault_tolerance.quorum_timeout_seconds, with a line that says the lighthouse at its address is gone."""
    port = free_port()
    lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process = launch(["--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "3000",
                          "--metrics.log_freq", "1", "--fault_tolerance.enable", "--fault_tolerance.group_size", "1",
                          "--fault_tolerance.quorum_timeout_seconds", "5", "--job.dump_folder", str(tmp_path)],
                         FT_LIGHTHOUSE=f"localhost:{port}")
        metrics = tmp_path / "replica_0" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    code, out = finish(process)
    assert code == 5, out[-3000:]
    assert one_error(out) == (f"error: fault tolerance: the lighthouse at localhost:{port} is gone (nothing answers "
                              "there any more), so no replica group can form a quorum; start it again and relaunch "
                              "the groups, or run it apart from any group's launcher (docs/fault_tolerance.md)")


@pytest.mark.budget("one launch that trains 2 steps before the signal (~20 s on 2 cores)")
def test_sigterm_reaches_the_ranks_and_the_started_lighthouse_ends(tmp_path):
    """With FT_LIGHTHOUSE=start torchrun is the launcher's child, not exec'd: a SIGTERM to the
    launcher still stops the ranks after a step (exit 143, one `stopped:` line), then the lighthouse."""
    port = free_port()
    process = launch(["--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "1000",
                      "--metrics.log_freq", "1", "--fault_tolerance.enable", "--fault_tolerance.group_size", "1",
                      "--job.dump_folder", str(tmp_path)], FT_LIGHTHOUSE="start", FT_LIGHTHOUSE_PORT=str(port))
    try:
        metrics = tmp_path / "replica_0" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert listening(port)
        process.send_signal(signal.SIGTERM)
        code, out = finish(process, timeout=60)
    finally:
        process.kill()
    stopped = [line for line in out.splitlines() if line.startswith("stopped:")]
    assert code == 143 and len(stopped) == 1 and "SIGTERM received; stopped after step" in stopped[0], out[-3000:]
    assert not listening(port), "the started lighthouse outlived its launcher"
