#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Fault-tolerant replica groups, measured: SIGKILL a rank of one group at a random step and check
that the other groups keep stepping, the killed group comes back and recovers live from a peer,
and every group ends with bitwise the same parameters.

    .venv/bin/python scripts/ft_trials.py                      # 10 trials, 2 groups x 2 ranks, FSDP 2 inside
    .venv/bin/python scripts/ft_trials.py --inner tp           # TP 2 inside each group instead
    .venv/bin/python scripts/ft_trials.py --groups 3 --trials 3 --out trials.json
    .venv/bin/python scripts/ft_trials.py --two-hosts          # groups split over 2 network namespaces (root)
    .venv/bin/python scripts/ft_trials.py --hosts 4 --groups 4 --whole-host   # a host lost with its group, replaced
    .venv/bin/python scripts/ft_trials.py --min-replicas 2 --reference   # losses against an uninterrupted run

Per trial: a fresh lighthouse (a short heartbeat timeout, so a dead group leaves the quorum in about
2 s), then G replica groups, each its own ./run_llama_train.sh job of R ranks with MAX_RESTARTS=1,
the debug model on short sequences, every step logged, a checkpoint every --checkpoint-interval
steps and at the last. Once the victim group has logged the randomly drawn kill step, one random
rank of it is killed with SIGKILL; torchrun restarts the group's ranks, they resume from the
group's checkpoint and, being behind, are sent the live state by a peer. Afterwards, from each
group's metrics.jsonl (a wall time per step) and log:

- survivors' longest pause: the largest gap between consecutive logged steps from the kill until
  the killed group logs a step again (failure detection), and after that (the rejoin: a quorum
  change and the state sent to the recovering group);
- went back: a survivor's step count that did not rise (a step logged twice or lower);
- retried: the survivors' "attempts not committed" (a step tried again with the same batch);
- recovery: seconds from the kill to the killed group's first step logged after it;
- equal: every group's final checkpoint holds bitwise the same model and optimizer tensors;
- losses equal (--reference, with --min-replicas equal to --groups, so that no step is committed
  without every group): every step each group logged has bitwise the loss of the same group and step
  in one uninterrupted run of the same groups, trained first.

With --hosts N the groups are spread over N simulated hosts (group g on host g mod N; the lighthouse
on host 0). --whole-host kills every process of the victim group's host at once (launcher and ranks:
a node lost, never host 0, which holds the lighthouse) and starts that host's groups again 3 s later,
as a scheduler replacing the node; they recover live from a peer like a restarted group.

Prints a markdown table; exits 1 if a trial failed (see Trial.passed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from torchtitan.tools.replica_groups import lighthouse_binary  # noqa: E402
from torchtitan.tools.runs import read_metrics  # noqa: E402

SUMMARY = re.compile(r"fault tolerance: (\d+) steps committed by replica group (\d+), (\d+) of them with fewer than "
                     r"\d+ groups; (\d+) attempts? not committed")
RECOVERED = "recovered live from a peer"
# State that legitimately differs between groups: each reads its own data shard with its own RNG.
PER_GROUP_STATE = ("dataloader", "rng", "train_state")


@dataclass
class Setup:
    """What every trial of a run trains: G groups of R ranks, with FSDP (`inner` "fsdp": the group's
    ranks shard the model) or TP (`inner` "tp": the group's ranks split every layer) inside each,
    committing a step with at least `min_replicas` groups."""

    groups: int = 2
    ranks: int = 2
    port: int = 29600
    steps: int = 40
    interval: int = 10  # checkpoint interval
    flavor: str = "debugmodel"
    seq_len: int = 128
    inner: str = "fsdp"
    min_replicas: int = 1
    quorum_timeout: int = 60  # seconds a group waits for min_replicas groups (survivors wait out a restart)


@dataclass
class Trial:
    victim_group: int
    victim_rank: int
    kill_step: int  # the victim group's newest logged step when it was killed
    pause_s: float | None  # survivors' longest gap between logged steps, from the kill to the killed group's return
    rejoin_pause_s: float | None  # survivors' longest gap after the killed group's first step back
    step_seconds: float | None  # survivors' median gap, for scale
    went_back: int  # survivors' logged steps that did not rise
    retried: int  # survivors' attempts not committed
    fewer_groups: int  # survivors' steps committed with fewer than all groups
    recovered_live: bool  # the killed group's log says so
    recovery_s: float | None  # kill -> the killed group's first logged step after it
    final_steps: list[int]
    params_equal: bool
    exit_codes: list[int]
    seconds: float
    detail: str = ""
    losses_equal: bool | None = None  # against the uninterrupted run (None: not compared)

    @property
    def passed(self) -> bool:
        alone = self.fewer_groups > 0 or self.losses_equal is not None  # survivors stepped alone, or waited
        return (self.params_equal and self.recovered_live and self.went_back == 0 and alone
                and self.losses_equal is not False and all(c == 0 for c in self.exit_codes))


def group_args(folder: Path, group: int, setup: Setup, host: str) -> list[str]:
    inner = ["--training.tensor_parallel_degree", str(setup.ranks)] if setup.inner == "tp" else []
    return ["--model.flavor", setup.flavor, "--training.steps", str(setup.steps), "--training.seq_len",
            str(setup.seq_len), "--training.batch_size", "2", "--training.warmup_steps", "2", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--checkpoint.enable_checkpoint", "--checkpoint.interval",
            str(setup.interval), "--job.dump_folder", str(folder), *inner, "--fault_tolerance.enable",
            "--fault_tolerance.group_size", str(setup.groups), "--fault_tolerance.replica_id", str(group),
            "--fault_tolerance.min_replica_size", str(setup.min_replicas), "--fault_tolerance.quorum_timeout_seconds",
            str(setup.quorum_timeout), "--fault_tolerance.lighthouse", f"{host}:{setup.port}"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHTITAN_REPORT_DIR", "TORCHELASTIC_RESTART_COUNT",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHFT_LIGHTHOUSE")}
    if sys.prefix != sys.base_prefix:  # the groups use this interpreter's virtual environment
        env.setdefault("TORCHTITAN_VENV", sys.prefix)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


class Cluster:
    """A lighthouse and G groups, on this machine or on simulated hosts (group g on host g mod N)."""

    def __init__(self, folder: Path, setup: Setup, hosts=None):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.hosts, self.procs = folder, hosts, []
        kw = dict(cwd=REPO_ROOT, stderr=subprocess.STDOUT, start_new_session=True)
        host = "localhost" if hosts is None else hosts.addresses[0]
        lighthouse = [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{setup.port}",
                      "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"]
        log = open(folder / "lighthouse.log", "w")
        self.lighthouse = self._popen(0, lighthouse, _env(), stdout=log, **kw)
        self.setup, self.address, self.kw = setup, host, kw
        for g in range(setup.groups):
            self.procs.append(self.start_group(g, "w"))

    def host_of(self, group: int) -> int:
        return 0 if self.hosts is None else group % self.hosts.n

    def start_group(self, g: int, mode: str = "a") -> subprocess.Popen:
        """Group `g`'s launcher (its log appended to, when it starts again after its host was lost)."""
        env = _env(NGPU=str(self.setup.ranks), MAX_RESTARTS="1", LOG_RANK="0")
        h = self.host_of(g)
        if self.hosts is not None:  # the address peers reach this group's manager at (_advertised_host)
            env.update(TORCHFT_HOSTNAME=self.hosts.addresses[h], GLOO_SOCKET_IFNAME=self.hosts.interfaces[h])
        out = open(self.folder / f"group_{g}.log", mode)
        return self._popen(h, ["./run_llama_train.sh", *group_args(self.folder, g, self.setup, self.address)], env,
                           stdout=out, **self.kw)

    def lose_host(self, host: int) -> list[int]:
        """Kills every process of `host` at once; returns the groups that ran there."""
        self.hosts.kill_host(host)
        lost = [g for g in range(self.setup.groups) if self.host_of(g) == host]
        for g in lost:
            self.procs[g].wait()
        return lost

    def _popen(self, host: int, cmd: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
        if self.hosts is None:
            return subprocess.Popen(cmd, env=env, **kw)
        return self.hosts.popen(host, cmd, env, **kw)

    def wait(self, deadline: float) -> list[int]:
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(p.wait())
        return codes

    def close(self) -> None:
        for p in [*self.procs, self.lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def rank_pids(folder: Path, group: int) -> dict[int, int]:
    """{rank within the group: pid} of group `group`'s trainer processes (not its launcher)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"torchtitan.train" not in argv or b"torchtitan.runtime.launch" in argv:
                continue
            if str(folder).encode() not in argv or argv[argv.index(b"--fault_tolerance.replica_id") + 1] != str(group).encode():
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(entry)
    return ranks


def group_rows(folder: Path, group: int) -> list[dict]:
    try:
        return read_metrics(folder / f"replica_{group}")
    except (OSError, ValueError):
        return []  # not written yet, or being rewritten by a restarting rank 0


def final_checkpoint(folder: Path, group: int) -> Path | None:
    steps = sorted((folder / f"replica_{group}" / "checkpoint").glob("step-*"), key=lambda p: int(p.name[5:]))
    return steps[-1] if steps else None


def same_tensors(checkpoints: list[Path], scratch: Path) -> tuple[bool, str]:
    """Whether the DCP checkpoints hold bitwise equal tensors (but for PER_GROUP_STATE)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for i, ckpt in enumerate(checkpoints):
        target = scratch / f"group_{i}.pt"
        dcp_to_torch_save(ckpt, target)
        state = torch.load(target, weights_only=False)
        target.unlink()
        states.append({k: v for k, v in _flatten(state).items() if not k.startswith(PER_GROUP_STATE)})
    first = states[0]
    for g, other in enumerate(states[1:], 1):
        if first.keys() != other.keys():
            return False, f"group {g}'s checkpoint has other entries: {sorted(first.keys() ^ other.keys())[:3]}"
        for key, value in first.items():
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other[key]):
                    return False, f"{key} differs between group 0 and group {g}"
            elif value != other[key]:
                return False, f"{key} differs between group 0 and group {g}: {value!r} vs {other[key]!r}"
    return True, f"{sum(isinstance(v, torch.Tensor) for v in first.values())} tensors equal"


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def kill_steps(steps: int) -> tuple[int, int]:
    """The kill step's range: late enough that every group steps, early enough that the survivors
    still train when the killed group is back (a restart takes seconds, the survivors go faster alone)."""
    return 3, max(3, steps // 3)


def run_trial(folder: Path, rng: random.Random, setup: Setup, timeout: float, hosts=None,
              kill_range: tuple[int, int] | None = None, reference: list[dict[int, float]] | None = None,
              whole_host: bool = False) -> Trial:
    """One trial: `reference` (reference_losses) compares every logged loss with an uninterrupted run's;
    `whole_host` loses the victim group's host (not host 0) and replaces it."""
    shutil.rmtree(folder, ignore_errors=True)
    victim, victim_rank = rng.randrange(setup.groups), rng.randrange(setup.ranks)
    if whole_host:
        victim = rng.choice([g for g in range(setup.groups) if g % hosts.n != 0])
    wanted = rng.randint(*(kill_range or kill_steps(setup.steps)))
    start = time.monotonic()
    cluster = Cluster(folder, setup, hosts)
    kill_time, kill_step = None, 0
    try:
        while time.monotonic() - start < timeout and all(p.poll() is None for p in cluster.procs):
            logged = [group_rows(folder, g) for g in range(setup.groups)]
            if all(logged) and logged[victim][-1]["step"] >= wanted:
                if whole_host:
                    kill_time, kill_step = time.time(), logged[victim][-1]["step"]
                    lost = cluster.lose_host(cluster.host_of(victim))
                    (folder / "kill.json").write_text(json.dumps({"time": kill_time, "step": kill_step, "group": victim,
                                                                  "host": cluster.host_of(victim), "groups": lost}))
                    time.sleep(3)
                    for g in lost:
                        cluster.procs[g] = cluster.start_group(g)
                    break
                pid = rank_pids(folder, victim).get(victim_rank)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kill_time, kill_step = time.time(), logged[victim][-1]["step"]
                    (folder / "kill.json").write_text(json.dumps({"time": kill_time, "step": kill_step, "group": victim,
                                                                  "rank": victim_rank}))
                    break
            time.sleep(0.05)
        codes = cluster.wait(start + timeout)
    finally:
        cluster.close()
    trial = measure(folder, setup.groups, victim, victim_rank, kill_step, kill_time, codes, time.monotonic() - start)
    if reference is not None:
        trial.losses_equal, note = same_losses(folder, reference)
        trial.detail = trial.detail or note
    return trial


def reference_losses(folder: Path, setup: Setup, timeout: float, hosts=None) -> list[dict[int, float]]:
    """The uninterrupted run the trials' losses are compared with: {step: loss} of each group."""
    shutil.rmtree(folder, ignore_errors=True)
    cluster = Cluster(folder, setup, hosts)
    try:
        codes = cluster.wait(time.monotonic() + timeout)
    finally:
        cluster.close()
    if any(codes):
        raise RuntimeError(f"the uninterrupted run failed (exit codes {codes}); see {folder}/group_*.log")
    return [{r["step"]: r["loss"] for r in group_rows(folder, g)} for g in range(setup.groups)]


def same_losses(folder: Path, reference: list[dict[int, float]]) -> tuple[bool, str]:
    """Whether every step each group logged (the killed group's before and after its restart) has
    bitwise the uninterrupted run's loss for that group and step."""
    for g, want in enumerate(reference):
        rows = group_rows(folder, g)
        if not rows or rows[-1]["step"] != max(want):
            return False, f"group {g} logged up to step {rows[-1]['step'] if rows else 0} of {max(want)}"
        for row in rows:
            if want.get(row["step"]) != row["loss"]:
                return False, f"group {g} step {row['step']}: loss {row['loss']!r}, uninterrupted {want.get(row['step'])!r}"
    return True, ""


def measure(folder: Path, groups: int, victim: int, victim_rank: int, kill_step: int, kill_time: float | None,
            codes: list[int], seconds: float) -> Trial:
    rows = [group_rows(folder, g) for g in range(groups)]
    logs = [(folder / f"group_{g}.log").read_text(errors="replace") for g in range(groups)]
    survivors = [g for g in range(groups) if g != victim]
    went_back = sum(1 for g in survivors for a, b in zip(rows[g], rows[g][1:]) if b["step"] <= a["step"])
    retried = fewer = 0
    for g in survivors:
        for m in SUMMARY.finditer(logs[g]):
            fewer += int(m[3])
            retried += int(m[4])
    pause = rejoin_pause = median = recovery = None
    if kill_time is not None:
        after = [r["time"] for r in rows[victim] if r["time"] > kill_time]
        back = after[0] if after else float("inf")
        recovery = after[0] - kill_time if after else None
        gaps = [(b["time"] - a["time"], b["time"]) for g in survivors for a, b in zip(rows[g], rows[g][1:])]
        pause = max((gap for gap, t in gaps if kill_time < t <= back), default=None)
        rejoin_pause = max((gap for gap, t in gaps if t > back), default=None)
        everyday = sorted(gap for gap, _ in gaps)
        median = everyday[len(everyday) // 2] if everyday else None
    checkpoints = [final_checkpoint(folder, g) for g in range(groups)]
    final_steps = [int(c.name[5:]) if c else 0 for c in checkpoints]
    detail = "" if kill_time is not None else "nothing was killed (the groups ended or timed out first)"
    equal = False
    if all(checkpoints) and len(set(final_steps)) == 1:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            equal, note = same_tensors(checkpoints, Path(scratch))
        detail = detail or ("" if equal else note)
    else:
        detail = detail or f"final checkpoints at steps {final_steps}"
    if any(codes) and not detail:
        detail = f"exit codes {codes}: " + logs[codes.index(next(c for c in codes if c))].strip()[-300:]
    return Trial(victim, victim_rank, kill_step, pause, rejoin_pause, median, went_back, retried, fewer, RECOVERED in logs[victim],
                 recovery, final_steps, equal, codes, seconds, detail)


HEADER = ("| trial | killed (group/rank) | kill step | survivors' longest pause s: after the kill / at the rejoin "
          "(median step s) | went back | retried | steps with fewer groups (survivors summed) | recovered live | "
          "recovery s | final step | parameters equal | losses equal to an uninterrupted run | wall s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def format_row(index: int, t: Trial) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def yes(x: bool | None) -> str:
        return "-" if x is None else ("yes" if x else "no")

    row = (f"| {index} | {t.victim_group}/{t.victim_rank} | {t.kill_step} | {num(t.pause_s)} / {num(t.rejoin_pause_s)} ({num(t.step_seconds)}) | "
           f"{t.went_back} | {t.retried} | {t.fewer_groups} | {yes(t.recovered_live)} | "
           f"{num(t.recovery_s)} | {'/'.join(map(str, t.final_steps))} | {yes(t.params_equal)} | {yes(t.losses_equal)} | "
           f"{t.seconds:.0f} |")
    return row + (f" {t.detail}" if t.detail else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--groups", type=int, default=2, help="replica groups (2 or more)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per group")
    p.add_argument("--seed", type=int, default=0, help="draws the killed group, rank and step")
    p.add_argument("--steps", type=int, default=40, help="steps per group (a kill step in 3 .. steps/3)")
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--flavor", default="debugmodel", help="the llama3 flavor trained")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--port", type=int, default=29600, help="the lighthouse's port")
    p.add_argument("--timeout", type=float, default=600, help="seconds per trial before it counts as hung")
    p.add_argument("--inner", choices=("fsdp", "tp"), default="fsdp",
                   help="the layout inside each group: FSDP over its ranks, or TP over its ranks")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="fault_tolerance.min_replica_size: with it equal to --groups the survivors wait for the "
                        "killed group instead of stepping alone")
    p.add_argument("--reference", action="store_true",
                   help="first train the groups once without a kill, and compare every trial's losses with it "
                        "(needs --min-replicas equal to --groups)")
    p.add_argument("--two-hosts", action="store_true", help="groups alternate between two network namespaces (root)")
    p.add_argument("--hosts", type=int, default=0, help="groups over this many network namespaces (root)")
    p.add_argument("--whole-host", action="store_true", help="lose the victim group's host, then replace it")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="a JSON file of the rows")
    args = p.parse_args(argv)
    n_hosts = args.hosts or (2 if args.two_hosts else 0)
    if args.whole_host and n_hosts < 2:
        print("error: --whole-host needs --hosts 2 or more (host 0 holds the lighthouse and is never lost)", file=sys.stderr)
        return 2
    if args.groups < 2 or args.ranks < 1 or args.steps < 9:
        print("error: --groups must be at least 2, --ranks at least 1 and --steps at least 9", file=sys.stderr)
        return 2
    if not 1 <= args.min_replicas <= args.groups or (args.reference and args.min_replicas != args.groups):
        print("error: --min-replicas must be between 1 and --groups, and equal to --groups with --reference (a step "
              "committed without every group is in no uninterrupted run)", file=sys.stderr)
        return 2
    setup = Setup(args.groups, args.ranks, args.port, args.steps, args.checkpoint_interval, args.flavor, args.seq_len,
                  args.inner, args.min_replicas, quorum_timeout=120 if args.min_replicas > 1 else 60)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ft-trials-"))
    print(f"runs in {workdir}; {args.trials} trials, {args.groups} groups x {args.ranks} ranks ({args.inner.upper()} "
          f"{args.ranks} inside), at least {args.min_replicas} per step{f' on {n_hosts} hosts' if n_hosts else ''}, "
          f"{args.steps} steps, seed {args.seed}", flush=True)
    rng = random.Random(args.seed)
    rows = []
    hosts = None
    if n_hosts:
        from tests.machinery.namespaces import SimulatedHosts, unavailable

        reason = unavailable()
        if reason:
            print(f"error: {n_hosts} simulated hosts cannot be built: {reason}", file=sys.stderr)
            return 2
        hosts = SimulatedHosts(n_hosts).__enter__()
    try:
        reference = reference_losses(workdir / "uninterrupted", setup, args.timeout, hosts) if args.reference else None
        print(HEADER, flush=True)
        for i in range(args.trials):
            rows.append(run_trial(workdir / f"trial-{i}", rng, setup, args.timeout, hosts, reference=reference,
                                  whole_host=args.whole_host))
            print(format_row(i + 1, rows[-1]), flush=True)
    finally:
        if hosts is not None:
            hosts.__exit__(None, None, None)
    if args.out:
        args.out.write_text(json.dumps([asdict(t) for t in rows], indent=1))
    passed = sum(t.passed for t in rows)
    print(f"{passed} of {len(rows)} trials: survivors never went back, the killed group recovered live, "
          "parameters bitwise equal" + (", losses bitwise those of the uninterrupted run" if args.reference else ""))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
