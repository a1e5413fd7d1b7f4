#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Automatic restart, measured: kill a rank, or a whole host, at a random step and check the job
finishes by itself with bitwise the losses of a run that was never interrupted.

    .venv/bin/python scripts/restart_trials.py                 # 10 trials, 2 ranks on this machine
    .venv/bin/python scripts/restart_trials.py --hosts 2       # 2 simulated hosts x 2 ranks (root, iproute2)
    .venv/bin/python scripts/restart_trials.py --hosts 4 --nproc 8 --whole-host         # a node lost, replaced
    .venv/bin/python scripts/restart_trials.py --hosts 4 --nproc 8 --whole-host --never-back --rdzv-timeout 30

One uninterrupted reference run first (the tiny debug model, a checkpoint every 2 steps, every step
logged; `--args` adds layout options). Then, per trial, the same job through run_llama_train.sh
with MAX_RESTARTS: once rank 0 has logged a randomly drawn step, one random rank is killed with
SIGKILL (with --hosts N, every rank of one random host). torchrun restarts every rank, which
resumes from the newest complete checkpoint. A trial passes when the job exits 0 on its own and its
per-step losses (metrics.jsonl, one row per step) equal the reference's exactly.

--whole-host kills the host's launcher with its ranks, as a node that loses power, and starts a
replacement launcher on that host `--replace-after` seconds later, as a scheduler replacing a node.
With --never-back no replacement comes: the trial passes when every surviving launcher ends within
RDZV_TIMEOUT and a margin, with one line naming the lost node. Host 0 holds the rendezvous (the
store every node meets at, RDZV_ENDPOINT), so it is never the host killed: losing it ends a c10d job.

Prints a table; exits 1 if any trial failed. A repository tool run from the checkout: it drives test
machinery (tests/machinery/namespaces.py for the hosts, tests/machinery/tiny_run.py for the job).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.machinery.namespaces import SimulatedHosts, unavailable  # noqa: E402
from tests.machinery.tiny_run import TINY_RUN  # noqa: E402
from torchtitan.tools.runs import read_metrics  # noqa: E402

RESTARTS_NOTE = re.compile(r"torchrun restarted the ranks (\d+) times?")
LOST_NODE = re.compile(r"NODE_RANK (\d+)")
RDZV_PORT = 29731


@dataclass
class Trial:
    kill_step: int
    killed: list[int]  # global ranks
    restarts: int | None  # from the launcher's note; None if it printed none
    seconds: float
    finished: bool  # exit code 0 without outside help
    bitwise_equal: bool
    detail: str = ""
    lost_node: int | None = None  # --never-back: the NODE_RANK killed, to be named by the survivors
    named: bool = False  # --never-back: every survivor's last line names it

    @property
    def passed(self) -> bool:
        if self.lost_node is not None:
            return self.named and not self.finished
        return self.finished and self.bitwise_equal and bool(self.restarts)


def job_args(folder: Path, steps: int, flavor: str = "debugmodel", extra: tuple[str, ...] = ()) -> list[str]:
    return [*TINY_RUN, "--model.flavor", flavor, "--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", "2", *extra, "--job.dump_folder", str(folder)]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHTITAN_REPORT_DIR", "TORCHELASTIC_RESTART_COUNT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


class Job:
    """One job: the launcher on this machine, or one launcher per simulated host."""

    def __init__(self, folder: Path, steps: int, nproc: int, hosts: SimulatedHosts | None, max_restarts: int,
                 flavor: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.cmd = ["./run_llama_train.sh", *job_args(folder, steps, flavor, extra)]
        self.common = {"MAX_RESTARTS": str(max_restarts), **(env or {})}
        self.kw = dict(cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.hosts, self.nproc = hosts, nproc
        if hosts is None:
            self.procs = [subprocess.Popen(self.cmd, env=_clean_env(NGPU=str(nproc), **self.common), **self.kw)]
        else:
            self.procs = [self.start_host(h) for h in range(hosts.n)]
        self.lost: list[subprocess.Popen] = []  # launchers killed with their host
        self.folder = folder

    def start_host(self, host: int) -> subprocess.Popen:
        env = self.hosts.node_env(host, self.nproc // self.hosts.n, RDZV_PORT, _clean_env(**self.common))
        return self.hosts.popen(host, self.cmd, env, **self.kw)

    def lose_host(self, host: int) -> None:
        """SIGKILLs the host's launcher and ranks at once (a node lost); its launcher leaves the job."""
        self.hosts.kill_host(host)
        self.lost.append(self.procs[host])
        self.procs[host] = None

    def replace_host(self, host: int) -> None:
        """A new launcher on the lost host, with the same NODE_RANK (a scheduler's replacement node)."""
        self.procs[host] = self.start_host(host)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs if p is not None)

    def wait(self, timeout: float) -> list[tuple[int, str]]:
        """[(exit code, stderr)] per launcher still in the job; kills everything left after `timeout`."""
        deadline = time.monotonic() + timeout
        ended = []
        for p in self.procs:
            if p is None:
                continue
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                _, err = p.communicate()
                err += f"\n(killed by restart_trials after {timeout:.0f} s)"
            ended.append((p.returncode, err))
        for p in self.lost:
            p.communicate()
        return ended


def rank_pids(folder: Path) -> dict[int, tuple[int, int]]:
    """{global rank: (pid, node)} of the trainer processes writing to `folder`."""
    found = subprocess.run(["pgrep", "-f", f"torchtitan.train.*{folder}"], capture_output=True, text=True).stdout
    ranks = {}
    for pid in found.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = (int(pid), int(env.get(b"GROUP_RANK", b"0")))
    return ranks


def logged_step(folder: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(folder)), default=0)
    except (OSError, ValueError):
        return 0  # not written yet, or being rewritten by a resuming rank 0


@dataclass(frozen=True)
class Faults:
    """What a trial does besides the kill: the layout options added to the job, and for --whole-host
    whether a replacement launcher comes (after `replace_after` s) or never (`never_back`)."""

    extra: tuple[str, ...] = ()
    whole_host: bool = False
    never_back: bool = False
    replace_after: float = 5.0
    rdzv_timeout: int = 0  # RDZV_TIMEOUT for the job (0: the launcher's default)

    def env(self) -> dict[str, str]:
        return {"RDZV_TIMEOUT": str(self.rdzv_timeout)} if self.rdzv_timeout else {}


def run_reference(workdir: Path, steps: int, nproc: int, hosts: SimulatedHosts | None, timeout: float,
                  flavor: str, faults: Faults = Faults()) -> list[float]:
    folder = workdir / "reference"
    shutil.rmtree(folder, ignore_errors=True)
    job = Job(folder, steps, nproc, hosts, 0, flavor, faults.extra)
    for code, err in job.wait(timeout):
        if code != 0:
            raise RuntimeError(f"the reference run failed ({code}): {err[-2000:]}")
    return [r["loss"] for r in read_metrics(folder)]


def run_trial(workdir: Path, index: int, reference: list[float], rng: random.Random, steps: int, nproc: int,
              hosts: SimulatedHosts | None, max_restarts: int, timeout: float, flavor: str,
              faults: Faults = Faults()) -> Trial:
    folder = workdir / f"trial-{index}"
    shutil.rmtree(folder, ignore_errors=True)
    kill_step = rng.randint(1, steps - 2)
    start = time.monotonic()
    job = Job(folder, steps, nproc, hosts, max_restarts, flavor, faults.extra, faults.env())
    killed: list[int] = []
    lost_node = None
    while job.alive() and time.monotonic() - start < timeout:
        if logged_step(folder) >= kill_step:
            ranks = rank_pids(folder)
            if hosts is None:
                victims = [rng.choice(sorted(ranks))]
            elif faults.whole_host:  # any host but the rendezvous's (host 0: see the module docstring)
                lost_node = rng.randrange(1, hosts.n)
                victims = sorted(r for r, (pid, _) in ranks.items() if pid in hosts.pids(lost_node))
                job.lose_host(lost_node)
            else:  # every rank of one host: a node's ranks lost, its launcher restarts them
                node = rng.choice(sorted({n for _, n in ranks.values()}))
                victims = sorted(r for r, (_, n) in ranks.items() if n == node)
            if not faults.whole_host:
                for rank in victims:
                    os.kill(ranks[rank][0], signal.SIGKILL)
            killed = victims
            break
        time.sleep(0.05)
    lost_at = time.monotonic()
    if lost_node is not None and not faults.never_back:
        time.sleep(faults.replace_after)
        job.replace_host(lost_node)
    ended = job.wait(max(1.0, timeout - (time.monotonic() - start)))
    seconds = time.monotonic() - start
    notes = [RESTARTS_NOTE.search(err) for _, err in ended]
    restarts = max((int(m[1]) for m in notes if m), default=None)
    finished = bool(killed) and all(code == 0 for code, _ in ended)
    losses = [r["loss"] for r in read_metrics(folder)] if (folder / "metrics.jsonl").exists() else []
    equal = losses == reference  # exact: float equality of every step's loss
    detail = "" if finished else f"exit codes {[c for c, _ in ended]}: {ended[0][1].strip()[-300:]}"
    if finished and not equal:
        diffs = [abs(a - b) for a, b in zip(losses, reference)]
        detail = f"{len(losses)} steps logged, max |diff| {max(diffs, default=float('nan')):.3g}"
    trial = Trial(kill_step, killed, restarts, seconds, finished, equal, detail)
    if faults.never_back and lost_node is not None:
        last_lines = [(err.strip().splitlines() or [""])[-1] for _, err in ended]
        trial.lost_node = lost_node
        naming = [code != 0 and f"NODE_RANK {lost_node}" in line for (code, _), line in zip(ended, last_lines)]
        trial.named = all(naming)
        others = "; ".join(f"exit {code}: {line[:200]}" for (code, _), line, ok in zip(ended, last_lines, naming) if not ok)
        trial.detail = (f"ended {time.monotonic() - lost_at:.1f} s after the loss; {sum(naming)} of {len(naming)} "
                        f"surviving launchers named it: {last_lines[0][:400]}" + (f"; the others: {others}" if others else ""))
    return trial


def run_trials(workdir: Path, trials: int = 10, seed: int = 0, steps: int = 10, hosts: int = 1, nproc: int = 2,
               max_restarts: int = 3, timeout: float = 600, log=print,
               reference: list[float] | None = None, flavor: str = "debugmodel", faults: Faults = Faults()) -> list[Trial]:
    """Runs the reference (unless its losses are given: `job_args` on `nproc` ranks, uninterrupted)
    and `trials` kill trials of llama3 `flavor` (or the model `faults.extra` names) under `workdir`;
    returns one Trial per trial."""
    if steps < 3:
        raise ValueError("--steps must be at least 3 (a kill step in 1 .. steps-2)")
    if hosts < 1 or nproc % hosts:
        raise ValueError(f"--nproc {nproc} does not split evenly over --hosts {hosts}")
    if faults.whole_host and hosts < 2:
        raise ValueError("--whole-host needs --hosts 2 or more (host 0 holds the rendezvous and is never the one lost)")
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    if hosts == 1:
        return _trials(workdir, trials, rng, steps, nproc, None, max_restarts, timeout, log, reference, flavor, faults)
    reason = unavailable()
    if reason:
        raise RuntimeError(f"{hosts} simulated hosts cannot be built: {reason}")
    with SimulatedHosts(hosts) as simulated:
        return _trials(workdir, trials, rng, steps, nproc, simulated, max_restarts, timeout, log, reference, flavor,
                       faults)


def _trials(workdir, trials, rng, steps, nproc, hosts, max_restarts, timeout, log, reference, flavor,
            faults) -> list[Trial]:
    if reference is None and not faults.never_back:
        start = time.monotonic()
        reference = run_reference(workdir, steps, nproc, hosts, timeout, flavor, faults)
        log(f"reference: {steps} steps uninterrupted in {time.monotonic() - start:.1f} s")
    rows = []
    for i in range(trials):
        rows.append(run_trial(workdir, i, reference or [], rng, steps, nproc, hosts, max_restarts, timeout, flavor,
                              faults))
        log(format_row(i + 1, rows[-1]))
    return rows


HEADER = "| trial | kill step | killed rank(s) | restarts | wall s | finished by itself | bitwise equal |"


def format_row(index: int, t: Trial) -> str:
    restarts = "none noted" if t.restarts is None else str(t.restarts)
    row = (f"| {index} | {t.kill_step} | {', '.join(map(str, t.killed)) or '-'} | {restarts} | {t.seconds:.1f} | "
           f"{'yes' if t.finished else 'no'} | {'yes' if t.bitwise_equal else 'no'} |")
    return row + (f" {t.detail}" if t.detail else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="draws the kill steps and ranks")
    p.add_argument("--steps", type=int, default=10, help="steps per job (a checkpoint every 2)")
    p.add_argument("--hosts", type=int, default=1, help="above 1: simulated hosts (network namespaces), ranks split evenly")
    p.add_argument("--whole-host", action="store_true", help="kill a host's launcher with its ranks, then replace it")
    p.add_argument("--never-back", action="store_true", help="with --whole-host: no replacement comes")
    p.add_argument("--replace-after", type=float, default=5.0, help="seconds before the replacement launcher starts")
    p.add_argument("--rdzv-timeout", type=int, default=0, help="RDZV_TIMEOUT for the job (0: the launcher's default)")
    p.add_argument("--args", default="", help="layout options added to the job, e.g. '--training.tensor_parallel_degree 2'")
    p.add_argument("--nproc", type=int, default=2, help="ranks in the whole job")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per job before it counts as hung")
    p.add_argument("--flavor", default="debugmodel", help="the llama3 flavor trained (tiny: a quarter of the time)")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.never_back and not args.whole_host:
        print("error: --never-back goes with --whole-host", file=sys.stderr)
        return 2
    faults = Faults(tuple(args.args.split()), args.whole_host, args.never_back, args.replace_after, args.rdzv_timeout)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="restart-trials-"))
    print(f"runs in {workdir}; {args.trials} trials, {args.nproc} ranks on {args.hosts} host(s), MAX_RESTARTS "
          f"{args.max_restarts}, seed {args.seed}\n{HEADER}\n| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    try:
        rows = run_trials(workdir, args.trials, args.seed, args.steps, args.hosts, args.nproc, args.max_restarts,
                          args.timeout, log=lambda line: print(line, flush=True) if line.startswith("|") else None,
                          flavor=args.flavor, faults=faults)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    passed = sum(t.passed for t in rows)
    print(f"{passed} of {len(rows)} trials " + ("ended with one line naming the lost node" if args.never_back else
                                              "finished by themselves with bitwise-equal losses"))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
