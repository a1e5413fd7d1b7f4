#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""A simulated cluster on one machine: many gloo ranks over simulated hosts (network namespaces
joined by a switch, tests/machinery/namespaces.py), one launcher per host as on real nodes
(NNODES, NODE_RANK, a c10d rendezvous at host 0). Needs root and iproute2. One command per scenario:

    .venv/bin/python scripts/sim_cluster.py parity --scenario moe4d-32      # 32 ranks on 8 hosts vs one process
    .venv/bin/python scripts/sim_cluster.py startup --ranks 4 8 16 32       # start-up per phase as the job grows
    .venv/bin/python scripts/sim_cluster.py straggler --link-mbit 20        # a host's link slowed: named?
    .venv/bin/python scripts/sim_cluster.py straggler --cpus 0.1            # a host's ranks throttled: named?
    .venv/bin/python scripts/sim_cluster.py step-time --scenario moe4d-32   # the planner's step-time model checked

A whole host lost mid-run (killed with its launcher, then replaced, or never back) is
scripts/restart_trials.py --hosts N --whole-host [--never-back]; replica groups that train on
through a lost group are scripts/ft_trials.py --hosts N. The planner's step-time model against
a scenario is `step-time` (scripts/step_time_check.py's check, run over the hosts; its link
microbenchmark runs on one host, so the figures between hosts are those within one: on one machine
a bridge and a loopback are alike). Figures and what they mean: docs/operations.md.

The model is Qwen3 `tiny_moe` (2 blocks, 8 experts) on 64-token sequences, so that 32 ranks fit in
the memory of a development machine (about 10 GiB); every rank runs one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.machinery.namespaces import SimulatedHosts, unavailable  # noqa: E402
from tests.machinery.netns import RDZV_PORT, run_on_hosts  # noqa: E402
from torchtitan.tools.parity import DEBUG_RUN, Layout, ParityHarness  # noqa: E402
from torchtitan.tools.parity_layouts import QWEN3_MOE  # noqa: E402
from torchtitan.tools.runs import read_metrics, read_setup, run_trainer  # noqa: E402

MOE = tuple(QWEN3_MOE.split())  # the parity suite's MoE model, so a test shares its seed and baseline
RANKS_PER_HOST = 4


@dataclass(frozen=True)
class Scenario:
    name: str
    hosts: int
    ranks_per_host: int
    overrides: tuple[str, ...]
    expect: tuple = ()

    @property
    def nproc(self) -> int:
        return self.hosts * self.ranks_per_host

    def layout(self) -> Layout:
        return Layout(self.name, self.nproc, self.overrides, self.expect, shared=MOE)


def _args(text: str) -> tuple[str, ...]:
    return tuple(text.split())


SCENARIOS = {s.name: s for s in (
    # The smallest, in CI (tests/integration/test_sim_cluster.py): every parallelism but CP, 8 ranks.
    Scenario("moe4d-8", 4, 2, _args("--experimental.pipeline_parallel_degree 2 --training.data_parallel_shard_degree 2 "
                                    "--training.tensor_parallel_degree 2 --training.expert_parallel_degree 2"),
             (("world_size", 8), ("pipeline.stages", 2), ("tp.mesh", {"tp": 2}), ("moe.ep_mesh", {"ep": 2}))),
    Scenario("moe4d-16", 4, 4, _args("--experimental.pipeline_parallel_degree 2 --training.data_parallel_shard_degree 4 "
                                     "--training.tensor_parallel_degree 2 --training.expert_parallel_degree 2"),
             (("world_size", 16), ("pipeline.stages", 2), ("tp.mesh", {"tp": 2}), ("moe.ep_mesh", {"ep": 2}))),
    Scenario("moe4d-32", 8, 4, _args("--experimental.pipeline_parallel_degree 2 --training.data_parallel_replicate_degree 2 "
                                     "--training.data_parallel_shard_degree 4 --training.tensor_parallel_degree 2 "
                                     "--training.expert_parallel_degree 2"),
             (("world_size", 32), ("pipeline.stages", 2), ("fsdp.mesh", {"dp_replicate": 2, "dp_shard_cp": 4}),
              ("tp.mesh", {"tp": 2}), ("moe.ep_mesh", {"ep": 2}))),
    Scenario("hsdp-cp-32", 8, 4, _args("--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 4 "
                                       "--training.tensor_parallel_degree 2 --experimental.context_parallel_degree 2 "
                                       "--training.expert_parallel_degree 4"),
             (("world_size", 32), ("fsdp.mesh", {"dp_replicate": 2, "dp_shard_cp": 8}), ("tp.mesh", {"tp": 2}),
              ("cp.mesh", {"cp": 2}), ("moe.ep_mesh", {"ep": 4}))),
)}


def hosts_runner(hosts: SimulatedHosts):
    """A parity Runner: one process here (the seed and the baseline), more over the hosts."""
    def run(args, nproc: int = 1, timeout: float = 1800, check: bool = True, extra_env=None):
        if nproc == 1:
            return run_trainer(args, nproc=1, timeout=timeout, check=check, extra_env=extra_env, cwd=REPO_ROOT)
        return run_on_hosts(hosts, args, nproc, timeout, extra_env)
    return run


def parity(scenario: Scenario, workdir: Path, steps: int, global_batch: int = 16, dataset_shards: int = 8) -> dict:
    """The scenario against one process from the same seed: loss and grad-norm differences. The
    data is read in `dataset_shards` shards (a multiple of every scenario's data-parallel degree)."""
    with SimulatedHosts(scenario.hosts) as hosts:
        harness = ParityHarness(workdir, steps=steps, global_batch=global_batch, dataset_shards=dataset_shards,
                                timeout=1800, runner=hosts_runner(hosts), base_args=DEBUG_RUN)
        start = time.monotonic()
        result = harness.check(scenario.layout())
        wall = time.monotonic() - start
    return {"scenario": scenario.name, "ranks": scenario.nproc, "hosts": scenario.hosts, "steps": steps,
            "max_loss_diff": result.max_loss_diff, "grad_norm_rel_diff": result.grad_norm_rel_diff,
            "wall_seconds": wall, "run_seconds": result.run.seconds}


def step_time(scenario: Scenario, steps: int = 6) -> dict:
    """The planner's predicted communication per collective kind and step time for the scenario,
    against what its ranks measured (scripts/step_time_check.py)."""
    from scripts import step_time_check

    with SimulatedHosts(scenario.hosts) as hosts:
        return step_time_check.check([*MOE, *scenario.overrides], scenario.nproc, runner=hosts_runner(hosts),
                                     hosts=scenario.hosts, steps=steps)


def launch(hosts: SimulatedHosts, args: list[str], nproc: int, env: dict[str, str] | None = None,
           timeout: float = 1800) -> subprocess.CompletedProcess:
    return run_on_hosts(hosts, args, nproc, timeout, {"LOG_RANK": "0", **(env or {})})


def startup_layout(ranks: int) -> tuple[str, ...]:
    """The 4-D MoE layout at `ranks` (4, 8, 16, 32): PP 2 x TP 2, then FSDP, then HSDP replicas."""
    shard = max(1, ranks // 4)
    replicate = 2 if shard > 4 else 1
    shard //= replicate
    return ("--experimental.pipeline_parallel_degree", "2", "--training.tensor_parallel_degree", "2",
            "--training.expert_parallel_degree", "2", "--training.data_parallel_shard_degree", str(shard),
            "--training.data_parallel_replicate_degree", str(replicate))


def startup(ranks: int, workdir: Path, steps: int = 3) -> dict:
    """Start-up per phase (the slowest rank's, from the setup record) of a short run at `ranks`."""
    hosts_n = max(1, ranks // RANKS_PER_HOST)
    folder = workdir / f"startup-{ranks}"
    args = [*DEBUG_RUN, *MOE, *startup_layout(ranks), "--training.steps", str(steps), "--training.batch_size", "2",
            "--job.dump_folder", str(folder)]
    with SimulatedHosts(hosts_n) as hosts:
        start = time.monotonic()
        launch(hosts, args, ranks)
        wall = time.monotonic() - start
    setup = read_setup(folder) or {}
    rows = read_metrics(folder)
    step_seconds = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:])]
    return {"ranks": ranks, "hosts": hosts_n, "wall_seconds": wall, "startup": setup.get("startup", {}),
            "steady_step_seconds": statistics.median(step_seconds) if step_seconds else None}


def straggler(workdir: Path, hosts_n: int, ranks: int, steps: int, slow_host: int, link_mbit: float | None,
              cpus: float | None) -> dict:
    """A clean run, then the same with one host's link slowed or its ranks throttled: the step
    time of each, and the step lines that name a slow node."""
    args = [*DEBUG_RUN, *MOE, "--training.data_parallel_shard_degree", str(ranks), "--training.steps", str(steps),
            "--metrics.log_freq", "2"]
    out: dict = {"ranks": ranks, "hosts": hosts_n, "slow_host": slow_host, "link_mbit": link_mbit, "cpus": cpus}
    with SimulatedHosts(hosts_n) as hosts:
        out["slow_address"] = hosts.addresses[slow_host]
        for kind in ("clean", "slowed"):
            folder = workdir / f"straggler-{kind}"
            if kind == "slowed" and link_mbit:
                hosts.slow_link(slow_host, link_mbit)
            procs = _start(hosts, [*args, "--job.dump_folder", str(folder)], ranks)
            if kind == "slowed" and cpus:
                time.sleep(2)  # the launcher's process is in the namespace by now; its ranks inherit the cap
                hosts.throttle(slow_host, cpus)
            output = _finish(procs)
            rows = read_metrics(folder)
            times = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:])]
            out[f"{kind}_step_seconds"] = statistics.median(times) / 2 if times else None  # rows every 2 steps
            out[f"{kind}_named"] = [ln.split("INFO - ")[-1] for ln in output.splitlines()
                                    if "step:" in ln and ("slow link" in ln or "slow compute" in ln or "slowest:" in ln)]
    return out


def _start(hosts: SimulatedHosts, args: list[str], nproc: int) -> list[subprocess.Popen]:
    env = {"OMP_NUM_THREADS": "1", "LOG_RANK": "0"}
    return [hosts.popen(h, ["./run_llama_train.sh", *args], hosts.node_env(h, nproc // hosts.n, RDZV_PORT, **env),
                        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for h in range(hosts.n)]


def _finish(procs: list[subprocess.Popen], timeout: float = 1800) -> str:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a launcher failed: {[p.returncode for p in procs]}: {outputs[0][-2000:]}")
    return outputs[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    par = sub.add_parser("parity", help="a scenario's losses against one process")
    par.add_argument("--scenario", choices=sorted(SCENARIOS), default="moe4d-32")
    par.add_argument("--steps", type=int, default=4)
    tm = sub.add_parser("step-time", help="the planner's step-time model against a scenario")
    tm.add_argument("--scenario", choices=sorted(SCENARIOS), default="moe4d-32")
    st = sub.add_parser("startup", help="start-up time per phase at several sizes")
    st.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    sg = sub.add_parser("straggler", help="a slowed or throttled host, and whether the step lines name it")
    sg.add_argument("--hosts", type=int, default=4)
    sg.add_argument("--ranks", type=int, default=8)
    sg.add_argument("--steps", type=int, default=8)
    sg.add_argument("--slow-host", type=int, default=2)
    sg.add_argument("--link-mbit", type=float, default=None, help="limit the host's outgoing link to this rate")
    sg.add_argument("--cpus", type=float, default=None, help="cap the host's ranks at this many cores")
    for sp in (par, tm, st, sg):
        sp.add_argument("--workdir", type=Path, default=None)
        sp.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"error: simulated hosts cannot be built here: {reason}", file=sys.stderr)
        return 2
    if args.command == "straggler" and (args.link_mbit is None) == (args.cpus is None):
        print("error: give one of --link-mbit and --cpus", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sim-cluster-"))
    if args.command == "parity":
        figures = parity(SCENARIOS[args.scenario], workdir, args.steps)
        print(f"{figures['scenario']}: {figures['ranks']} ranks on {figures['hosts']} hosts, {figures['steps']} steps: "
              f"max |loss diff| {figures['max_loss_diff']:.3e}, final grad-norm rel diff "
              f"{figures['grad_norm_rel_diff']:.3e}; the layout's run {figures['run_seconds']:.0f} s")
    elif args.command == "step-time":
        from scripts import step_time_check

        figures = step_time(SCENARIOS[args.scenario])
        print(step_time_check.table(figures))
    elif args.command == "startup":
        figures = [startup(n, workdir) for n in args.ranks]
        phases = sorted({k for f in figures for k in f["startup"]}, key=list(figures[-1]["startup"]).index)
        print("| ranks | hosts | " + " | ".join(phases) + " | steady step s | launch to exit s |")
        print("| ---: " * (len(phases) + 4) + "|")
        for f in figures:
            cells = " | ".join(f"{f['startup'].get(k, float('nan')):.2f}" for k in phases)
            print(f"| {f['ranks']} | {f['hosts']} | {cells} | {f['steady_step_seconds'] or float('nan'):.2f} | "
                  f"{f['wall_seconds']:.1f} |")
    else:
        figures = straggler(workdir, args.hosts, args.ranks, args.steps, args.slow_host, args.link_mbit, args.cpus)
        print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
