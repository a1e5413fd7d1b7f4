"""The step-time check's measuring side, in this process: the trace reader's kinds and payloads on a
hand-built chrome trace (torchtitan/tools/comm_trace.py), the benchmark's fit
(torchtitan/tools/comm_bench.py), and scripts/step_time_check.py end to end with a runner that
writes a finished run's files instead of training, and its refusals. The planner's side is
test_planner.py; the measured tables are docs/memory.md's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from scripts import step_time_check
from torchtitan.errors import UserError
from torchtitan.estimation.planner import Hardware, Model, by_kind, traffic
from torchtitan.tools import comm_bench, comm_trace

MAIN, GLOO = 1, 2  # thread ids


def op(name: str, ts: float, dur: float, tid: int = MAIN, **args) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def shapes(dims: list, types: list, **more) -> dict:
    return {"Input Dims": dims, "Input type": types, **more}


def trace() -> dict:
    """One step of every kind, as PyTorch 2.13 records them on gloo (comm_trace's docstring)."""
    return {"traceEvents": [
        op("ProfilerStep#6", 0, 1000),
        # DTensor's all-gather: the functional op (dtype) around the coalesced c10d op (shapes)
        op("_c10d_functional::all_gather_into_tensor", 10, 10,
           **shapes([[4, 32, 16], [], []], ["float", "Scalar", ""], **{"Concrete Inputs": ["", "2", ""]})),
        op("c10d::allgather_into_tensor_coalesced_", 11, 5,
           **shapes([[[8, 32, 16]], [[4, 32, 16]], [], []], ["TensorList", "TensorList", "", "Scalar"])),
        op("_c10d_functional::wait_tensor", 22, 3, **shapes([[8, 32, 16]], ["float"])),  # a wait, no call
        # FSDP's: output first, then input, typed
        op("c10d::_allgather_base_", 30, 3, **shapes([[100], [50], [], [], []], ["c10::BFloat16", "c10::BFloat16"])),
        op("c10d::_reduce_scatter_base_", 40, 3, **shapes([[50], [100], [], []], ["float", "float"])),
        # a plain all-reduce of a list: the dtype from gloo's span of the same shape that starts next
        op("gloo:all_reduce", 45, 2, GLOO, **shapes([[3]], ["float"])),  # an earlier call's
        op("c10d::allreduce_", 50, 3, **shapes([[[3]], [], []], ["TensorList", "", ""])),
        op("gloo:all_reduce", 52, 5, GLOO, **shapes([[3]], ["double"])),
        op("c10d::alltoall_base_", 60, 3, **shapes([[10, 4], [6, 4], [], []], ["float", "float"])),
        op("c10d::send", 70, 4, **shapes([[[2, 8]], [], []], ["TensorList", "", ""])),
        op("gloo:send", 71, 2, **shapes([[2, 8]], ["c10::BFloat16"])),
        op("c10d::recv_", 80, 4, **shapes([[[2, 8]], [], []], ["TensorList", "", ""])),  # no span: fp32
        # the list form of all-gather: its input times the world
        op("c10d::allgather_", 90, 3, **shapes([[], [[]], [], []], ["", "TensorList", "", "Scalar"])),
        op("gloo:all_gather", 91, 2, GLOO, **shapes([[]], ["double"])),
        op("c10d::broadcast_", 95, 2, **shapes([[[5]], []], ["TensorList", ""])),
    ]}


def test_the_trace_reader_maps_each_op_to_its_kind_and_payload():
    calls = comm_trace.calls(trace(), world=4)
    assert [(c["kind"], c["bytes"]) for c in calls] == [
        ("all_gather", 8 * 32 * 16 * 4), ("all_gather", 100 * 2), ("reduce_scatter", 100 * 4), ("all_reduce", 3 * 8),
        ("all_to_all", 6 * 4 * 4), ("send_recv", 16 * 2), ("send_recv", 16 * 4), ("all_gather", 4 * 8),
        ("broadcast", 5 * 4)]
    table = comm_trace.by_kind(calls)
    assert table["all_gather"] == {"count": 3, "bytes": 16384 + 200 + 32} and table["broadcast"]["count"] == 1
    two = comm_trace.mean_over_ranks([table, comm_trace.by_kind([])])
    assert two["all_gather"] == {"count": 1.5, "bytes": (16384 + 200 + 32) / 2} and two["broadcast"]["count"] == 0.5


def test_a_functional_collective_without_its_c10d_op_is_read_from_its_own_shapes():
    lone = {"traceEvents": [op("_c10d_functional::all_gather_into_tensor", 0, 5,
                                **shapes([[4, 8], [], []], ["c10::BFloat16", "Scalar", ""],
                                         **{"Concrete Inputs": ["", "4", ""]})),
                             op("_c10d_functional::reduce_scatter_tensor", 10, 5,
                                **shapes([[16, 8], [], [], []], ["float", "", "Scalar", ""]))]}
    assert [(c["kind"], c["bytes"]) for c in comm_trace.calls(lone, 4)] == [("all_gather", 4 * 8 * 4 * 2),
                                                                             ("reduce_scatter", 16 * 8 * 4)]


def test_the_benchmark_fit_recovers_latency_and_bandwidth():
    samples = [(hops, wire, hops * 50e-6 + wire / 2e9) for hops in (1, 2, 6) for wire in (1e3, 1e5, 4e6)]
    fitted = comm_bench.fit(samples)
    assert fitted["latency_us"] == pytest.approx(50) and fitted["gbps"] == pytest.approx(2)
    bandwidth_only = comm_bench.fit([(1, wire, wire / 1e9) for wire in (1e3, 1e6)])
    assert bandwidth_only["latency_us"] == pytest.approx(0, abs=1e-6) and bandwidth_only["gbps"] == pytest.approx(1)
    assert comm_bench._pairs(8, 4, across=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert comm_bench._pairs(8, 4, across=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert comm_bench._pairs(6, 3, across=False) == [[0, 1], [3, 4]]


ARGS = ["--training.data_parallel_shard_degree", "2", "--model.flavor", "tiny"]
HW = Hardware(gpus_per_node=2, peak_tflops=0.05, efficiency=1.0, intra_node_gbps=0.5, intra_node_latency_us=500.0,
              layer_overhead_ms=2.0, overlap=False, reduce_scatter_as_all_reduce=True)


def finished_run(nproc: int, steps: int, rank_trace: dict | None):
    """A runner that leaves what a finished run leaves: metrics rows 1 s apart but step 3's (2 s),
    and the traced step's files (none when `rank_trace` is None)."""
    def run(args, nproc_=1, **kwargs):
        assert nproc_ == nproc and kwargs["extra_env"] == {"OMP_NUM_THREADS": "1"}
        folder = Path(args[args.index("--job.dump_folder") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        times = [100.0 + step + (step >= 3) for step in range(1, steps + 1)]
        with open(folder / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"record": "setup", "model": {"vocab_size": 2256}}) + "\n")
            f.writelines(json.dumps({"step": s, "time": t, "loss": 8.0}) + "\n" for s, t in zip(range(1, steps + 1), times))
        if rank_trace is not None:
            traces = folder / "profile_traces" / f"iteration_{steps}"
            traces.mkdir(parents=True)
            for rank in range(nproc):
                (traces / f"rank{rank}_trace.json").write_text(json.dumps(rank_trace))
        return subprocess.CompletedProcess(["fake"], 0, "", "")
    return run


def test_check_compares_the_traced_step_with_the_planners_traffic(tmp_path):
    """With the hardware given (no calibration) the report holds the traces' mean by kind beside
    traffic()'s, their errors, the median steady gap of steps 2-4 and the step's terms."""
    report = step_time_check.check(ARGS, 2, finished_run(2, 6, trace()), steps=6, hardware=HW, dump=tmp_path)
    model = Model.from_flavor("llama3", "tiny", 2256)
    layout, precision, _ = step_time_check.layout_of([*step_time_check.BASE_ARGS, *ARGS], 2)
    predicted = by_kind(traffic(model, layout, HW, 64, 0, imbalance=1.0, precision=precision))
    rows = report["collectives"]
    assert rows["all_gather"]["measured"] == {"count": 3, "bytes": 16384 + 200 + 2 * 8}  # the world is 2 here
    assert rows["all_gather"]["predicted"] == predicted["all_gather"] and rows["broadcast"]["predicted"]["count"] == 0
    assert rows["reduce_scatter"]["count_error"] == pytest.approx(predicted["reduce_scatter"]["count"] - 1)
    assert rows["broadcast"]["count_error"] == -1.0
    assert report["step"]["samples_s"] == [1.0, 2.0, 1.0] and report["step"]["measured_s"] == 1.0
    assert report["step"]["error"] == pytest.approx(report["step"]["predicted_s"] - 1.0)
    assert report["step"]["beyond_tolerance"] == (abs(report["step"]["error"]) > step_time_check.TOLERANCE)
    terms = report["terms_s"]
    assert report["layout"] == "dp_shard 2, AC none, batch 4" and terms["fsdp"] > 0 and terms["host"] > 0
    assert report["dominant"] == sorted((k for k in terms if terms[k] > 0), key=lambda k: -terms[k])
    text = step_time_check.table(report)
    assert "| all_gather | " in text and "| all_to_all |" in text and "error" in text and "load average" in text


def test_check_refusals(tmp_path, monkeypatch, capsys):
    with pytest.raises(UserError, match="--steps must be at least 4"):
        step_time_check.check(ARGS, 2, finished_run(2, 3, trace()), steps=3, hardware=HW)
    with pytest.raises(UserError, match="3 ranks do not spread evenly over 2 hosts"):
        step_time_check.check(ARGS, 3, finished_run(3, 6, trace()), hosts=2, hardware=HW)
    with pytest.raises(UserError, match="expected 2 traces of step 6"):
        step_time_check.check(ARGS, 2, finished_run(2, 6, None), hardware=HW, dump=tmp_path)
    with pytest.raises(UserError, match="printed no RESULT line"):
        step_time_check.bench_result("just noise\n")
    monkeypatch.setattr(step_time_check.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "the rendezvous failed"))
    with pytest.raises(UserError, match=r"the communication benchmark failed \(1\): the rendezvous failed"):
        step_time_check.local_bench(["torchtitan.tools.comm_bench"], 2)
    assert step_time_check.main(["--layout", "fsdp4", "--steps", "3"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --steps must be at least 4")
    with pytest.raises(SystemExit):
        step_time_check.main(["--", "--training.steps", "2"])


def test_relative_errors_and_steady_gaps():
    assert step_time_check.relative_error(5, 4) == 0.25 and step_time_check.relative_error(0, 0) == 0.0
    assert step_time_check.relative_error(1, 0) is None
    rows = [{"step": s, "time": 10.0 * s} for s in range(1, 7)]
    assert step_time_check.steady_step_seconds(rows, 6) == [10.0, 10.0, 10.0]
