"""The test suite's warm launcher: one process imports the trainer once, then forks a fresh job
per run; `run_warm` is the runner the tests pass wherever a `Runner` is taken.

Importing torch and the trainer costs about 3 s per process on a small CPU machine, which is a
quarter of a short test run. `WarmLauncher` starts `python -m tests.machinery.warm_launcher` from
the repository root once; that server imports `torchtitan.train` and then, for each request, forks
a job process with the request's working directory, environment and output files. A job with one
rank runs `torchtitan.train.main` itself; a job with more forks its ranks through `local_ranks`.
The server runs no torch code of its own, so every fork starts clean. Test machinery only: users
launch with run_llama_train.sh (torchrun), and scripts with `torchtitan.tools.runs.run_trainer`;
the launcher's tests cover those paths.

Protocol (one JSON object per line): the client sends {"nproc", "args", "env", "cwd", "stdout",
"stderr"}; the server answers {"pid"} when the job starts (the job leads its own process
group, so a timeout can kill all its ranks) and {"code"} when it ends, the code being what
subprocess reports (negative for a signal).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchtitan.tools.runs import raise_for_exit, trainer_env

REPO_ROOT = Path(__file__).resolve().parents[2]


def _stop_coverage() -> None:
    """The whole suite measures every process, this server included, and its forks restart the
    measurement; a job of an `unmeasured` test (tests/conftest.py) stops it, and its ranks, forked
    from it without the variable that starts coverage, then run unmeasured too."""
    try:
        import coverage
    except ImportError:
        return
    current = coverage.Coverage.current()
    if current is not None:
        current.stop()


def _run_job(request: dict) -> int:
    """In the forked job process: becomes the requested run and returns its exit code."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "COVERAGE_PROCESS_CONFIG" not in os.environ:
        _stop_coverage()
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # What the interpreter does with PYTHONPATH at start-up (after the working directory).
    extra_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra_paths
    import torch

    # The server imported torch without running it, so the thread count is still unset.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    nproc, args = request["nproc"], request["args"]
    if nproc == 1:
        from torchtitan import train

        return train.main(args)
    from tests.machinery import local_ranks

    return local_ranks.main([str(nproc), *args])


def serve() -> None:
    """The server loop: one job at a time, each in a fresh fork of this warm process."""
    import torchtitan.train  # noqa: F401 - the warm import every job inherits

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_job(request)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - a crash becomes the job's exit code
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


class WarmLauncher:
    """Client of one warm server; `run` behaves like subprocess.run with captured text output."""

    def __init__(self, repo_root: Path, env: dict[str, str]):
        self.repo_root = repo_root
        self._lock = threading.Lock()
        self._server = subprocess.Popen([sys.executable, "-m", "tests.machinery.warm_launcher"], cwd=repo_root,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # One reader for the server's whole life, so an answer that arrives after a timeout is
        # still received in order.
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_answers, daemon=True).start()

    def _read_answers(self) -> None:
        for line in self._server.stdout:
            self._answers.put(line)
        self._answers.put("")  # the server exited

    def alive(self) -> bool:
        return self._server.poll() is None

    def _reply(self, timeout: float | None) -> dict:
        """The server's next answer; raises TimeoutError when none comes within `timeout`."""
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if not line:
            raise RuntimeError("the warm launcher's server exited")
        return json.loads(line)

    def run(self, nproc: int, args: list[str], env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"nproc": nproc, "args": list(args), "env": env, "cwd": str(self.repo_root), "stdout": out,
                       "stderr": err}
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            pid = self._reply(timeout=60)["pid"]
            try:
                code = self._reply(timeout)["code"]
            except TimeoutError:
                os.killpg(pid, 9)  # the job and every rank it forked
                self._reply(timeout=60)
                raise subprocess.TimeoutExpired(["warm", str(nproc), *args], timeout) from None
            with open(out, errors="replace") as f, open(err, errors="replace") as g:
                stdout, stderr = f.read(), g.read()
        return subprocess.CompletedProcess(["warm", str(nproc), *args], code, stdout, stderr)

    def close(self) -> None:
        if self.alive():
            self._server.stdin.close()
            self._server.wait(timeout=30)


# This process's warm servers, started on first use. A server runs one job at a time; runs made at
# once (replica groups, each its own job that must meet the others) get a server each.
_WARM: list[WarmLauncher] = []
_IDLE: list[WarmLauncher] = []
_POOL_LOCK = threading.Lock()


def _take_launcher() -> WarmLauncher:
    with _POOL_LOCK:
        _IDLE[:] = [w for w in _IDLE if w.alive()]
        if _IDLE:
            return _IDLE.pop(0)
        launcher = WarmLauncher(REPO_ROOT, trainer_env())
        _WARM.append(launcher)
        atexit.register(launcher.close)
        return launcher


def _give_back(launcher: WarmLauncher) -> None:
    with _POOL_LOCK:
        _IDLE.insert(0, launcher)


def run_warm(args: Sequence[str], nproc: int = 1, timeout: float | None = 300, check: bool = True,
             extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A `Runner` (torchtitan.tools.runs) that forks the run from a warm server, in the repository
    root: one process, or `nproc` ranks forked by local_ranks, one thread per rank unless
    `extra_env` says otherwise. Runs made at once from several threads each get a server."""
    launcher = _take_launcher()
    try:
        result = launcher.run(nproc, list(args), trainer_env(extra_env), timeout)
    finally:
        _give_back(launcher)
    return raise_for_exit(result) if check else result


if __name__ == "__main__":
    serve()
