"""The step breakdown by op category (torchtitan/tools/op_breakdown.py): exact attribution on
hand-built chrome traces, and a real profiler trace of a tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.tools.op_breakdown import (
    CATEGORIES,
    attention_flops,
    breakdown,
    categorize,
    load_breakdown,
    matmul_flops,
    mean_breakdown,
)

MAIN, HELPER, AUTOGRAD = 1, 2, 3  # thread ids


def op(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def mm(ts: float, dur: float, m: int, k: int, n: int, tid: int = MAIN) -> dict:
    return op("aten::mm", ts, dur, tid, **{"Input Dims": [[m, k], [k, n]], "Input type": ["float", "float"]})


def cpu_trace() -> dict:
    """One 1,000 us step on the main thread with every category, nesting, a collective inside the
    optimizer, an op running past the step's end, and a helper thread busy the whole time."""
    attention_dims = {"Input Dims": [[2, 4, 32, 8]] * 3, "Concrete Inputs": ["", "", "", "0.", "True", "", ""]}
    events = [
        op("ProfilerStep#4", 0, 1000, cat="user_annotation"),
        # forward linear: 10 us of dispatch around an 80 us mm, all matmul
        op("aten::linear", 10, 100, **{"Input Dims": [[64, 32], [16, 32], [16]]}),
        op("aten::t", 12, 2),
        op("aten::matmul", 15, 90, **{"Input Dims": [[64, 32], [32, 16]]}),
        mm(20, 80, 64, 32, 16),
        # backward: the autograd wrappers' own 20 us (and their transpose's) are overhead
        op("autograd::engine::evaluate_function: MmBackward0", 120, 100),
        op("MmBackward0", 121, 98),
        mm(130, 40, 64, 16, 32),
        op("aten::t", 171, 2),
        mm(175, 40, 16, 64, 32),
        # attention: the SDPA region, causal flash kernel inside
        op("aten::scaled_dot_product_attention", 230, 100, **{**attention_dims, "Concrete Inputs": [""] * 5 + ["True"]}),
        op("aten::_scaled_dot_product_flash_attention_for_cpu", 235, 90, **attention_dims),
        op("aten::empty", 240, 1),
        # norm: elementwise and reductions
        op("aten::rms_norm", 340, 40),
        op("aten::pow", 341, 9), op("aten::mean", 351, 9), op("aten::rsqrt", 361, 4), op("aten::mul", 366, 13),
        # a cast
        op("aten::to", 390, 10), op("aten::_to_copy", 391, 8), op("aten::copy_", 392, 6),
        # the loss region claims the fill inside nll_loss
        op("aten::cross_entropy_loss", 410, 40), op("aten::log_softmax", 411, 19), op("aten::_log_softmax", 412, 17),
        op("aten::nll_loss_nd", 431, 18), op("aten::nll_loss", 432, 16), op("aten::fill_", 433, 1),
        # a collective claims the copy inside it
        op("record_param_comms", 460, 40), op("c10d::allreduce_", 461, 38), op("aten::copy_", 470, 10),
        # FSDP's unrecorded wait for its reduce-scatter is the span's self time; the copy-in (whatever
        # aten ops it runs) stays a copy
        op("FSDP::post_backward_reduce (layers.0)", 510, 80, cat="user_annotation"),
        op("fsdp::chunk_cat", 515, 20), op("aten::cat", 516, 18),
        op("record_param_comms", 540, 5),
        # the optimizer claims everything inside it but a collective
        op("Optimizer.step#AdamW.step", 600, 300, cat="user_annotation"),
        op("aten::_foreach_mul_", 610, 40), op("aten::mul_", 611, 38),
        op("aten::copy_", 700, 20),
        mm(750, 10, 64, 64, 64),
        op("c10d::allgather_", 800, 20),
        # cut at the step's end: 5 us of it count
        op("aten::add", 995, 15),
        # other threads: left out of the shares, reported as busy time
        mm(0, 1000, 512, 512, 512, tid=HELPER),
        op("gloo:all_reduce", 500, 100, tid=HELPER, cat="user_annotation"),
        op("PyTorch Profiler (0)", -5, 1100, tid=0, cat="Trace"),
    ]
    return {"traceEvents": events, "deviceProperties": []}


def test_cpu_attribution_is_exact():
    b = breakdown(cpu_trace())
    assert b.timeline == "main thread (CPU)" and b.steps == 1 and b.step_ms == 1.0
    expected_us = {"matmul": 100 + 80, "attention": 100, "elementwise": 40 + 5, "copy": 10 + 20, "loss": 40,
                   "communication": 40 + (80 - 20) + 20 + (10 + 10), "optimizer": 300 - 20}
    expected_us["other"] = 1000 - sum(expected_us.values())
    assert expected_us["other"] == 10 + 10 + 20 + 10 + 10 + 10 + 10 + 20 + 95 - 10  # gaps and wrapper overhead
    assert {c: round(ms * 1e3, 6) for c, ms in b.ms.items()} == expected_us
    assert sum(b.share(c) for c in CATEGORIES) == pytest.approx(100)
    assert b.other_threads_ms == 1.0
    # gloo's all-reduce (500-600 us) is hidden only under the FSDP span's copy (515-535); the gaps
    # 500-510 and 590-600 (outside any event) are waits for it, so exposed communication above.
    assert b.overlapped_ms * 1e3 == pytest.approx(20)
    assert dict(b.top["communication"])["(waiting, no event: a collective in flight)"] == pytest.approx(0.02)
    # Only the innermost matmuls outside other regions: not aten::linear/matmul around the forward mm,
    # not the mm inside the optimizer.
    assert b.matmul_flops == 3 * 2 * 64 * 32 * 16
    assert b.tflops("matmul") == pytest.approx(b.matmul_flops / 180e-6 / 1e12)
    assert b.attention_flops == 2 * 2 * 4 * 32 * 32 * (8 + 8) / 2  # causal: half
    assert b.tflops("loss") is None and b.compute_dtype == "float32"
    assert b.top["other"][0] == ("(outside any event)", pytest.approx(0.165))
    assert dict(b.top["optimizer"])["aten::copy_"] == pytest.approx(0.02)


def test_steps_and_ranks_are_averaged():
    trace = cpu_trace()
    second = [{**e, "ts": e["ts"] + 2000} for e in trace["traceEvents"] if e["tid"] in (MAIN, HELPER)]
    second[0]["name"] = "ProfilerStep#5"
    one = breakdown(trace)
    two = breakdown({"traceEvents": trace["traceEvents"] + second})
    assert two.steps == 2 and two.ms == pytest.approx(one.ms) and two.matmul_flops == one.matmul_flops
    mean = mean_breakdown([one, two])
    assert mean.ms == pytest.approx(one.ms) and mean.step_ms == one.step_ms


def test_gpu_kernels_take_their_launching_op_category():
    """On a CUDA trace the GPU timeline is broken down: kernels by the op that launched them (on any
    thread), overlaps counted once with compute before communication, the window extended to the
    last kernel the step launched, and gaps idle."""
    def launch(ts: float, correlation: int, tid: int = MAIN) -> dict:
        return op("cudaLaunchKernel", ts, 2, tid, cat="cuda_runtime", correlation=correlation)

    def kernel(name: str, ts: float, dur: float, correlation: int, stream: int = 7) -> dict:
        return op(name, ts, dur, stream, cat="kernel", correlation=correlation, device=0)

    events = [
        op("ProfilerStep#3", 0, 1000, cat="user_annotation"),
        mm(10, 10, 256, 256, 256), launch(12, 1),
        op("record_param_comms", 30, 10), launch(32, 2),
        op("aten::add", 50, 10), launch(52, 3),
        mm(70, 10, 256, 256, 256, tid=AUTOGRAD), launch(72, 4, tid=AUTOGRAD),
        kernel("sm90_xmma_gemm_f32f32", 100, 300, 1),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 300, 2, stream=8),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 900, 200, 3),
        kernel("cutlass_80_tensorop_gemm", 450, 50, 4),
        kernel("sm90_xmma_gemm_f32f32", 1200, 10, 99),  # launched in another step
    ]
    b = breakdown({"traceEvents": events, "deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}]})
    assert b.timeline == "GPU streams" and b.device_name == "NVIDIA H100 80GB HBM3"
    assert b.step_ms == 1.1
    assert {c: round(ms * 1e3, 6) for c, ms in b.ms.items() if ms} == {
        "matmul": 300 + 50, "communication": 200 - 50, "elementwise": 200, "other": 100 + 300}
    assert b.matmul_flops == 2 * 2 * 256**3  # both threads' mms
    # The all-reduce kernel (300-600) runs under the gemms on another stream for 300-400 and 450-500.
    assert b.overlapped_ms * 1e3 == pytest.approx(100 + 50)
    assert b.exposure()["exposed_comm"] * 1e3 == pytest.approx(150)
    assert b.tflops("matmul") == pytest.approx(b.matmul_flops / 350e-6 / 1e12)


def test_exposed_and_overlapped_communication_on_cpu():
    """A synchronous collective is exposed even though gloo's thread moves its bytes; an
    asynchronous one (FSDP's prefetch) is overlapped while the main thread computes and exposed
    from the moment the main thread waits for it (the self time of the copy-out, or no event at all)."""
    gloo = HELPER
    events = [
        op("ProfilerStep#2", 0, 1000, cat="user_annotation"),
        # synchronous: the main thread sits in the collective while gloo runs it
        op("FSDP::all_gather (layers.0)", 100, 100, cat="user_annotation"),
        op("c10d::_allgather_base_", 105, 90),
        op("gloo:all_gather", 106, 88, tid=gloo, cat="user_annotation"),
        # asynchronous: issued in 5 us, in flight 306-700 while the main thread computes until 600
        op("FSDP::forward_prefetch for layers.1", 300, 5, cat="user_annotation"),
        op("c10d::_allgather_base_", 300, 5),
        op("gloo:all_gather", 306, 394, tid=gloo, cat="user_annotation"),
        mm(305, 295, 64, 64, 64),
        # the copy-out waits 600-700 for it, then copies 700-720
        op("FSDP::all_gather_copy_out (layers.1)", 600, 120, cat="user_annotation"),
        op("fsdp::split_with_sizes_copy", 700, 20),
        mm(720, 200, 64, 64, 64),
        # issued asynchronously and waited for with no event (Work.wait()): exposed
        op("c10d::allreduce_", 930, 5), op("gloo:all_reduce", 935, 40, tid=gloo, cat="user_annotation"),
        op("aten::sqrt", 975, 5),
        # a collective after the step ends counts nothing
        op("gloo:all_reduce", 1001, 50, tid=gloo, cat="user_annotation"),
    ]
    b = breakdown({"traceEvents": events})
    exposed_us = 100 + 5 + 100 + 5 + 40
    overlapped_us = 600 - 306
    assert b.ms["communication"] * 1e3 == pytest.approx(exposed_us)
    assert b.overlapped_ms * 1e3 == pytest.approx(overlapped_us)
    e = b.exposure()
    assert e["compute"] * 1e3 == pytest.approx(295 + 20 + 200 + 5)
    assert e["compute"] + e["exposed_comm"] + e["other"] == pytest.approx(b.step_ms)
    # Without the prefetch, the same all-gather waited for where it is issued is exposed, not hidden.
    sync = [*events[:4], *events[11:14], op("FSDP::all_gather (layers.1)", 300, 400, cat="user_annotation"),
            op("gloo:all_gather", 301, 398, tid=gloo, cat="user_annotation"),
            op("FSDP::all_gather_copy_out (layers.1)", 700, 20, cat="user_annotation"),
            op("fsdp::split_with_sizes_copy", 700, 20), mm(720, 200, 64, 64, 64)]
    b = breakdown({"traceEvents": sync})
    assert b.overlapped_ms == 0 and b.ms["communication"] * 1e3 == pytest.approx(100 + 400 + 5 + 40)


def test_pipeline_send_and_receive_in_flight_on_the_issuing_thread():
    """gloo records a point-to-point send or receive on the thread that issued it, from issue to
    completion: a send under compute is overlapped, a receive waited for with no event is exposed."""
    events = [
        op("ProfilerStep#2", 0, 1000, cat="user_annotation"),
        op("c10d::send", 100, 5), op("gloo:send", 104, 296, cat="user_annotation"),
        mm(105, 295, 64, 64, 64),
        op("c10d::recv_", 500, 2), op("gloo:recv", 501, 299, cat="user_annotation"),
        mm(800, 100, 64, 64, 64),
    ]
    b = breakdown({"traceEvents": events})
    assert b.overlapped_ms * 1e3 == pytest.approx(400 - 105)
    assert b.ms["communication"] * 1e3 == pytest.approx(5 + 2 + (800 - 502))
    assert b.ms["matmul"] * 1e3 == pytest.approx(295 + 100)


@pytest.mark.parametrize("name,category", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::_weight_int4pack_mm_for_cpu", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_efficient_attention_forward", "attention"), ("flex_attention", "attention"),
    ("graph_1_cpp_fused_flex_attention_0", "attention"),
    ("aten::_fused_rms_norm", "elementwise"), ("aten::silu_backward", "elementwise"), ("aten::cat", "elementwise"),
    ("graph_0_cpp_fused_add_mean_mul_pow_rsqrt_0", "elementwise"),
    ("graph_0_cpp_fused__scaled_dot_product_flash_attention_for_cpu_backward_transpose_view_2", "elementwise"),
    ("triton_poi_fused_mul_silu_1", "elementwise"),
    ("graph_0_cpp_fused__unsafe_view_mm_3", "matmul"), ("triton_tem_fused_addmm_relu_0", "matmul"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("aten::_to_copy", "copy"), ("aten::clone", "copy"), ("aten::_foreach_copy_", "copy"),
    ("fsdp::all_gather_copy_in", "copy"),
    ("aten::_log_softmax_backward_data", "loss"), ("aten::nll_loss_forward", "loss"),
    ("graph_1_cpp_fused__log_softmax__log_softmax_backward_data__unsafe_view_arange_cl", "loss"),
    ("_c10d_functional::wait_tensor", "communication"), ("c10d::_reduce_scatter_base_", "communication"),
    ("record_param_comms", "communication"), ("c10d::send", "communication"),
    ("Optimizer.step#AdamW.step", "optimizer"), ("aten::_foreach_lerp_", "optimizer"),
    ("aten::view", None), ("aten::t", None), ("MmBackward0", None), ("Torch-Compiled Region: 0/0", None),
    ("## Call CompiledFxGraph abc ##", None), ("aten::hadamard", "elementwise"),
    ("FSDP::all_gather (layers.0)", "communication"), ("FSDP::post_backward_reduce", "communication"),
    ("FSDP::all_gather_copy_out (layers.0)", "communication"), ("FSDP::pre_forward (layers.0)", None),
])
def test_categories(name, category):
    assert categorize(name) == category


def test_matmul_flops():
    assert matmul_flops("aten::addmm", [[16], [8, 4], [4, 16]]) == 2 * 8 * 4 * 16
    assert matmul_flops("aten::bmm", [[3, 8, 4], [3, 4, 16]]) == 2 * 3 * 8 * 4 * 16
    assert matmul_flops("aten::matmul", [[2, 3, 8, 4], [4, 16]]) == 2 * 6 * 8 * 4 * 16  # broadcast
    assert matmul_flops("aten::linear", [[5, 8, 4], [16, 4], []]) == 2 * 40 * 4 * 16
    assert matmul_flops("aten::_grouped_mm", [[40, 4], [3, 4, 16], [3]]) == 2 * 40 * 4 * 16  # each row one expert
    assert matmul_flops("aten::mm", [[8]]) == 0  # shapes that do not fit count nothing


def test_attention_flops():
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    causal = {"Input Dims": [[2, 4, 32, 8]] * 3, "Concrete Inputs": ["", "", "", "0.", "True"]}
    assert attention_flops(sdpa, causal) == 2 * 2 * 4 * 32 * 32 * (8 + 8) / 2
    # Shapes a trace leaves out or records otherwise (no dims, scalars, a 3-D query) count nothing.
    for dims in ([], [[2, 4, 32, 8]], [[], [], []], [[4, 32, 8]] * 3, [None] * 3):
        assert attention_flops(sdpa, {"Input Dims": dims}) == 0, dims
    assert attention_flops(sdpa, {}) == 0


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(self.norm(x))))


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_real_profiler_trace(tmp_path):
    """A tiny model's forward and backward, profiled as the trainer does (a schedule, shapes
    recorded, the chrome trace written when the active step ends)."""
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(4, 16, 32)
    path = tmp_path / "rank0_trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as profiler:
        for _ in range(2):
            model(x).square().mean().backward()
            profiler.step()
    b = load_breakdown(path)
    assert b.timeline == "main thread (CPU)" and b.steps == 1
    assert b.ms["matmul"] > 0 and b.ms["elementwise"] > 0
    assert sum(b.ms.values()) == pytest.approx(b.step_ms) and sum(map(b.share, CATEGORIES)) == pytest.approx(100)
    # forward, input gradient and weight gradient of both linears over 64 tokens
    assert b.matmul_flops == 3 * 2 * 64 * (32 * 64 + 64 * 32)
    assert b.compute_dtype == "float32" and b.tflops("matmul") > 0
