"""Where a training step's time goes, by op category, from a PyTorch profiler chrome trace.

Attribution. The step is the `ProfilerStep#k` span on the thread that recorded it (the main
thread; on CPU, autograd runs backward on it too). Its events nest (aten::linear -> aten::matmul
-> aten::mm), and each one's *self time* (its span minus its children's) is charged exactly once,
so every microsecond of the step lands in one category and the shares sum to 100 %:

- A *region* claims all time inside it, children included. Regions, highest precedence first:
  communication (c10d / functional collectives, their waits, `record_param_comms`), optimizer
  (the `Optimizer.step#...` span and the foreach / fused optimizer kernels, gradient clipping's
  `_foreach_norm` included), attention (SDPA and its flash / efficient / cuDNN / math kernels,
  flex attention), loss (cross entropy, log_softmax, nll_loss), copy (FSDP's `fsdp::` copy-in
  and copy-out ops). So a copy inside a collective is communication, a multiply inside AdamW is
  optimizer, a cat inside FSDP's copy-in is a copy.
- Elsewhere time goes to the innermost event with a category of its own: matmul, elementwise
  (norms, RoPE, activations, reductions, inductor's fused `cpp_fused_*` / `triton_*_fused_*`
  kernels), copies/casts, and communication for FSDP's all-gather and reduce-scatter spans,
  whose self time is mostly the wait for the collective, which the profiler records no event for.
  View and allocation ops, autograd wrappers (`MmBackward0`), compiled region wrappers and other
  annotations have none: their self time goes to the category of the nearest categorised event
  around them (the transpose inside aten::linear is matmul work).
- Time covered by no categorised event (Python, dispatch, the autograd engine, waiting, data
  loading) is idle/other.

Events on other threads (gloo's, data workers') are left out of the shares; their busy time is
reported separately. On CUDA traces the same is done on the GPU timeline instead: each kernel
takes the category of the CPU event that launched it (matched by correlation id; by its name when
there is none), overlapping kernels on several streams count once, with compute before
communication (so communication is what is exposed), and gaps are idle. (That path has been
checked on hand-built traces only, no real CUDA trace yet.)

Exposed and overlapped communication. The communication share above is *exposed*: time the step's
timeline spent in a collective or waiting for one, with no compute of its own. *Overlapped*
communication is reported beside the shares, not in them: the time a collective was in flight
while the timeline did something else. On CPU a collective issued asynchronously (FSDP's
prefetched all-gathers, gloo's work queue) runs on gloo's own threads, which record it as a
`gloo:*` span; the union of those spans (and of any other communication event off the main
thread, and gloo's point-to-point sends and receives, which the issuing thread records from issue
to completion), minus the main thread's own communication time, is overlapped: while the main thread
waits for a collective, that collective is exposed, whichever thread moves its bytes. Waiting on a
collective's Work (`wait()`, a pipeline's receive, the gradient-norm all-reduce) records no event,
so main-thread time outside any event while a collective is in flight counts as exposed too (at
worst it was Python between ops; that is small beside a wait). On the GPU
timeline a communication kernel that runs while a compute kernel runs on another stream is
overlapped; one running alone is exposed.

Achieved FLOP/s of a category are its FLOPs over all the time charged to it, dispatch included.
FLOPs come from `Input Dims` (record_shapes): 2*m*k*n for the innermost matmul op with a known
formula (mm, addmm, bmm, baddbmm, matmul, linear, grouped mm), and for attention
2*b*h*sq*sk*(d_qk + d_v) forward (4*b*h*sq*sk*d), 2.5x that backward, halved when causal; an
attention mask other than plain causality counts as full.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.runtime.torch_compat.op_names import GROUPED_MM_NAME, PRIVATE_MATMUL_NAMES

# Categories in table order, with the labels a reader sees.
LABELS = {
    "matmul": "matmul",
    "attention": "attention",
    "elementwise": "norm/RoPE/activation (elementwise)",
    "copy": "casts and copies",
    "loss": "loss",
    "communication": "communication (exposed)",
    "optimizer": "optimizer",
    "other": "idle/other",
}
CATEGORIES = tuple(LABELS)
# A region claims all time inside it, children included; when regions nest, the category listed
# first here wins.
REGIONS = ("communication", "optimizer", "attention", "loss", "copy")
# On the GPU timeline, which of several overlapping kernels a moment belongs to.
GPU_PRECEDENCE = ("matmul", "attention", "optimizer", "loss", "elementwise", "copy", "communication")

_RULE_PATTERNS = (  # (category, pattern on the event name, a region?); the first match decides
    ("communication", r"^(c10d::|_?c10d_functional(_autograd)?::|gloo:|nccl:)|^record_param_comms$|wait_tensor"
                      r"|^nccl|ncclDevKernel|ncclKernel", True),
    # FSDP waits for its all-gathers and reduce-scatters inside these spans, and the profiler records
    # no event for a wait on a collective's Work: their self time is that wait (plus a little Python).
    # Not regions: the copies inside stay copies.
    # An asynchronous (prefetched) all-gather is waited for at the start of the copy-out.
    ("communication", r"^FSDP::(all_gather|all_gather_copy_out|post_backward_reduce|post_backward_rs_wait)( \(|$)",
     False),
    ("copy", r"^fsdp::", True),  # FSDP's copy-in / copy-out ops, whatever aten ops they run
    # Inductor's kernels are named after every op they fuse ("cpp_fused_add_mean_mul_pow_rsqrt_0"). A
    # compiled flex attention or loss, or a GEMM template, names its op; any other fused kernel is
    # elementwise work, even one named after the attention kernel whose output it transposes (the
    # attention itself runs outside it, as an extern kernel).
    ("attention", r"(?i)flex_attention", True),
    ("loss", r"cross_entropy|log_softmax|nll_loss", True),
    ("matmul", r"(cpp|triton_tem)_fused_(.*_)?(mm|addmm|bmm|baddbmm)_", False),
    ("elementwise", r"cpp_fused_|^triton_(poi|red|per)_fused", False),
    ("copy", r"^aten::_foreach_copy_$", False),  # FSDP's all-gather copy-in, not an optimizer update
    ("optimizer", r"^Optimizer\.(step|zero_grad)#|^aten::_foreach_|^aten::_fused_(adam|adamw|sgd|adagrad)"
                  r"|multi_tensor_apply|(?i:(^|[^a-z])adam)", True),
    ("attention", r"(?i)scaled_dot_product|flash_attention|flash_attn|efficient_attention|cudnn_attention"
                  r"|fmha|flash_(fwd|bwd)|sdpa", True),
    ("matmul", r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_int_mm|_scaled_mm|_grouped_mm|"
               r"_scaled_grouped_mm|addmv|mv|dot|vdot|einsum|_weight_int[48]pack_mm\w*)$"
               r"|^(mkldnn::_linear_pointwise|mkl::_mkl_linear|aten::mkldnn_linear)"
               r"|gemm|gemv|cutlass|xmma|cublas|^nvjet", False),
    ("copy", r"^aten::(_to_copy|copy_|to|type_as|clone|contiguous|_copy_from\w*|lift_fresh_copy|"
             r"split_with_sizes_copy|_chunk_cat)$|^Memcpy|^Memset", False),
    ("elementwise", r"elementwise|reduce_kernel", False),  # CUDA's own kernels, on the GPU timeline
)
_RULES = tuple((category, re.compile(pattern), region) for category, pattern, region in _RULE_PATTERNS)
# aten ops that move no data (views, allocations, metadata, syncs): their self time is dispatch.
_NO_WORK = re.compile(
    r"^aten::(view|_unsafe_view|reshape|_reshape_alias|t|transpose|permute|expand|expand_as|as_strided|"
    r"unsqueeze|squeeze|slice|select|split|split_with_sizes|chunk|unbind|narrow|alias|detach|detach_|"
    r"empty|empty_like|empty_strided|new_empty|new_empty_strided|resize_|set_|lift_fresh|view_as|"
    r"view_as_real|view_as_complex|_conj|resolve_conj|resolve_neg|flatten|unflatten|movedim|"
    r"result_type|item|_local_scalar_dense|is_nonzero|size|stride|numel|broadcast_tensors)$")

# Attention kernels with a FLOP formula: name -> (index of query, of is_causal, backward?).
# Key and value follow the query; the CUDA-internal _flash_attention_* ops (sequence-major
# layout) sit inside these and are not counted again.
_ATTENTION_OPS = {
    "aten::scaled_dot_product_attention": (0, 5, False),
    "aten::_scaled_dot_product_attention_math": (0, 5, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 4, False),
    "aten::_scaled_dot_product_flash_attention": (0, 4, False),
    "aten::_scaled_dot_product_efficient_attention": (0, 6, False),
    "aten::_scaled_dot_product_cudnn_attention": (0, 6, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7, True),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11, True),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11, True),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 14, True),
}
# Profiler input type -> dtype name, for the compute dtype the matmuls ran in.
_DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16", "double": "float64"}
_GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str) -> tuple[str | None, bool]:
    """(category, whether the event is a region) of an event of this name. The category is None
    for one without (views, allocations, autograd and compiled-region wrappers, annotations),
    which takes its surroundings'. Any other aten op is elementwise work."""
    for category, pattern, region in _RULES:
        if pattern.search(name):
            return category, region
    if name.startswith("aten::") and not _NO_WORK.match(name):
        return "elementwise", False
    return None, False


def categorize(name: str) -> str | None:
    """The category an event of this name carries itself (see classify)."""
    return classify(name)[0]


def matmul_flops(name: str, dims: list) -> float:
    """FLOPs of one matmul op from its input shapes; 0 when the shapes do not fit the op."""
    op = name.removeprefix("aten::")
    try:
        if op in ("addmm", "baddbmm", "addbmm"):  # the added input comes first
            dims = dims[1:]
        a, b = list(dims[0]), list(dims[1])
        if op == "linear":  # weight is (out, in)
            return 2.0 * math.prod(a) * b[0]
        if op == GROUPED_MM_NAME and len(a) == 2 and len(b) == 3:  # each row meets one group's weight
            return 2.0 * math.prod(a) * b[2]
        if op not in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", *PRIVATE_MATMUL_NAMES):
            return 0.0
        a, b = (a if len(a) > 1 else [1, *a]), (b if len(b) > 1 else [*b, 1])
        batch = max(math.prod(a[:-2]), math.prod(b[:-2]))  # broadcast batch dims
        return 2.0 * batch * a[-2] * a[-1] * b[-1]
    except (IndexError, TypeError, ValueError):
        return 0.0


def attention_flops(name: str, args: dict) -> float:
    """FLOPs of one attention kernel from its input shapes and is_causal; 0 when unknown."""
    query, causal_at, backward = _ATTENTION_OPS[name]
    dims, concrete = args.get("Input Dims", []), args.get("Concrete Inputs", [])
    try:
        (b, h, sq, d), (_, _, sk, _), (*_, dv) = dims[query], dims[query + 1], dims[query + 2]
    except (IndexError, TypeError, ValueError):
        return 0.0
    flops = 2.0 * b * h * sq * sk * (d + dv)
    if causal_at < len(concrete) and concrete[causal_at] == "True":
        flops /= 2
    return 2.5 * flops if backward else flops


@dataclass
class Breakdown:
    """One step's time by category, mean over the trace's profiled steps."""

    timeline: str  # "main thread (CPU)" or "GPU streams"
    steps: int
    step_ms: float
    ms: dict[str, float]  # per category, summing to step_ms
    matmul_flops: float = 0.0  # per step, in the time charged to matmul
    attention_flops: float = 0.0
    compute_dtype: str | None = None  # what the matmuls' inputs were
    device_name: str | None = None  # a GPU's name, None on CPU
    other_threads_ms: float = 0.0  # busy time of threads left out of the shares
    overlapped_ms: float = 0.0  # communication in flight while the timeline did something else (not in the shares)
    notes: list[str] = field(default_factory=list)
    top: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # per category: (event name, self ms)

    def share(self, category: str) -> float:
        return 100 * self.ms[category] / self.step_ms if self.step_ms else 0.0

    def exposure(self) -> dict[str, float]:
        """ms per step: compute (every category but communication and idle/other), exposed
        communication, overlapped communication (hidden under the rest, not part of the step's sum),
        and idle/other."""
        compute = sum(ms for c, ms in self.ms.items() if c not in ("communication", "other"))
        return {"compute": compute, "exposed_comm": self.ms["communication"], "overlapped_comm": self.overlapped_ms,
                "other": self.ms["other"]}

    def tflops(self, category: str) -> float | None:
        """Achieved TFLOP/s while in `category` (matmul or attention), None where it does not apply."""
        flops = {"matmul": self.matmul_flops, "attention": self.attention_flops}.get(category)
        if not flops or not self.ms[category]:
            return None
        return flops / (self.ms[category] / 1e3) / 1e12

    def to_json(self) -> dict:
        return {"timeline": self.timeline, "steps": self.steps, "step_ms": self.step_ms,
                "categories": {c: {"label": LABELS[c], "ms": self.ms[c], "share_percent": self.share(c),
                                   "tflops": self.tflops(c)} for c in CATEGORIES},
                "matmul_flops": self.matmul_flops, "attention_flops": self.attention_flops,
                "compute_dtype": self.compute_dtype, "device_name": self.device_name,
                "other_threads_ms": self.other_threads_ms, "exposure_ms": self.exposure(), "notes": self.notes,
                "top": {c: [{"name": name, "ms": ms} for name, ms in names] for c, names in self.top.items()}}


class _Node:
    __slots__ = ("name", "start", "end", "args", "children")

    def __init__(self, name: str, start: float, end: float, args: dict):
        self.name, self.start, self.end, self.args, self.children = name, start, end, args, []


def _tree(events: list[dict], start: float, end: float) -> _Node:
    """The events of one thread inside [start, end] as a tree under a root spanning it. A child
    that outlasts its parent (timestamp rounding) is cut at the parent's end, so siblings never
    overlap and self times add up to the root's span."""
    root = _Node("", start, end, {})
    stack = [root]
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        s, f = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        while len(stack) > 1 and s >= stack[-1].end:
            stack.pop()
        f = min(f, stack[-1].end)
        if f <= s:
            continue
        node = _Node(e["name"], s, f, e.get("args", {}))
        stack[-1].children.append(node)
        stack.append(node)
    return root


@dataclass
class _Tally:
    """Sums over one step (or several): microseconds and self time by event name per category,
    FLOPs, and which category each GPU launch was made in."""

    us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    by_name: dict[tuple[str, str], float] = field(default_factory=dict)  # (category, name) -> us
    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    dtype_flops: dict[str, float] = field(default_factory=dict)
    launches: dict[int, str] = field(default_factory=dict)  # correlation id -> category
    comm_spans: list[tuple[float, float]] = field(default_factory=list)  # where the timeline was in communication
    idle_spans: list[tuple[float, float]] = field(default_factory=list)  # where it was outside any event
    overlapped_us: float = 0.0

    def charge(self, category: str, name: str, us: float) -> None:
        self.us[category] += us
        self.by_name[category, name] = self.by_name.get((category, name), 0.0) + us

    def add(self, other: _Tally, times: bool = True) -> None:
        """Adds `other`'s FLOPs and launches, and its times when `times`."""
        if times:
            for (category, name), us in other.by_name.items():
                self.charge(category, name, us)
        self.overlapped_us += other.overlapped_us
        self.matmul_flops += other.matmul_flops
        self.attention_flops += other.attention_flops
        for dtype, flops in other.dtype_flops.items():
            self.dtype_flops[dtype] = self.dtype_flops.get(dtype, 0.0) + flops
        self.launches.update(other.launches)


def _walk(node: _Node, region: str | None, inner: str | None, tally: _Tally) -> tuple[bool, bool]:
    """Charges `node`'s self time and FLOPs; returns whether a matmul / attention op with a FLOP
    count lies in its subtree, so only the innermost one is counted."""
    own, claims = classify(node.name) if node.name else (None, False)
    if claims and (region is None or REGIONS.index(own) < REGIONS.index(region)):
        region = own
    inner = own or inner
    category = region or inner or "other"
    below_mm = below_attn = False
    for child in node.children:
        mm, attn = _walk(child, region, inner, tally)
        below_mm, below_attn = below_mm or mm, below_attn or attn
    self_us = (node.end - node.start) - sum(c.end - c.start for c in node.children)
    tally.charge(category, node.name or "(outside any event)", self_us)
    if category == "communication" or not node.name:  # its self time: the gaps between its children
        edges = [node.start, *(t for c in node.children for t in (c.start, c.end)), node.end]
        spans = tally.comm_spans if node.name else tally.idle_spans
        spans += [(s, f) for s, f in zip(edges[::2], edges[1::2]) if f > s]
    if "correlation" in node.args:
        tally.launches[node.args["correlation"]] = category
    here_mm = own == "matmul" and not below_mm and bool(flops := matmul_flops(node.name, node.args.get("Input Dims", [])))
    if here_mm and category == "matmul":
        tally.matmul_flops += flops
        dtype = next((_DTYPES[t] for t in node.args.get("Input type", []) if t in _DTYPES), None)
        if dtype:
            tally.dtype_flops[dtype] = tally.dtype_flops.get(dtype, 0.0) + flops
    here_attn = node.name in _ATTENTION_OPS and not below_attn and bool(flops := attention_flops(node.name, node.args))
    if here_attn and category == "attention":
        tally.attention_flops += flops
    return below_mm or here_mm, below_attn or here_attn


def _gpu_timeline(kernels: list[dict], launches: dict[int, str], start: float, end: float, tally: _Tally) -> None:
    """Charges [start, end] on the GPU timeline: where kernels overlap, the one of highest
    GPU_PRECEDENCE counts; where none runs, idle/other."""
    edges = []
    for k in kernels:
        category = launches.get(k.get("args", {}).get("correlation"), "other")
        if category == "other":  # launched outside any categorised op: the kernel's own name decides
            category = categorize(k["name"]) or ("elementwise" if k.get("cat") == "kernel" else "copy")
        s, f = max(k["ts"], start), min(k["ts"] + k["dur"], end)
        if f > s:
            edges += [(s, 1, GPU_PRECEDENCE.index(category), k["name"]), (f, -1, GPU_PRECEDENCE.index(category), k["name"])]
    running: list[dict[str, int]] = [{} for _ in GPU_PRECEDENCE]  # per category: kernel name -> count
    comm = GPU_PRECEDENCE.index("communication")
    last = start
    for t, delta, rank, name in sorted(edges, key=lambda edge: edge[:2]):
        top = next((r for r, names in enumerate(running) if names), None)
        if top is None:
            tally.charge("other", "(GPU idle)", t - last)
        else:
            tally.charge(GPU_PRECEDENCE[top], next(iter(running[top])), t - last)
            if top != comm and running[comm]:  # a collective under compute on another stream
                tally.overlapped_us += t - last
        running[rank][name] = running[rank].get(name, 0) + delta
        if not running[rank][name]:
            del running[rank][name]
        last = t
    tally.charge("other", "(GPU idle)", end - last)


def _comm_spans(nodes: list[_Node]) -> list[tuple[float, float]]:
    """The spans of the outermost communication events among `nodes` and their descendants."""
    spans = []
    for node in nodes:
        if categorize(node.name) == "communication":
            spans.append((node.start, node.end))
        else:
            spans += _comm_spans(node.children)
    return spans


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint spans covering the same time as `spans`."""
    merged: list[tuple[float, float]] = []
    for s, f in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], f))
        else:
            merged.append((s, f))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time covered by both of two sorted, disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, f = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if f > s:
            out.append((s, f))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(f - s for s, f in spans)


def _step_tally(step: dict, by_thread: dict[tuple, list[dict]], kernels: list[dict]) -> tuple[_Tally, float, float]:
    """(tally, wall microseconds, busy microseconds of other threads) of one ProfilerStep span."""
    start, end = step["ts"], step["ts"] + step["dur"]
    main = (step["pid"], step["tid"])
    tally = _Tally()
    _walk(_tree(by_thread.get(main, []), start, end), None, None, tally)
    if not kernels:
        others, in_flight = 0.0, []
        for thread, events in by_thread.items():
            if thread != main:
                tops = _tree(events, start, end).children
                others += sum(c.end - c.start for c in tops)
                in_flight += _comm_spans(tops)
        # gloo's point-to-point work (pipeline sends and receives) is recorded on the issuing thread,
        # from issue to completion: in flight, not time that thread spent (the tree cuts it short).
        in_flight += [(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in by_thread.get(main, [])
                      if e["name"].startswith(("gloo:", "nccl:")) and e["ts"] < end and e["ts"] + e["dur"] > start]
        in_flight = _union(in_flight)
        # Waiting on a collective's Work records no event: outside any event while one is in flight
        # is that wait, so exposed.
        waited = _length(_intersection(in_flight, _union(tally.idle_spans)))
        tally.charge("other", "(outside any event)", -waited)
        tally.charge("communication", "(waiting, no event: a collective in flight)", waited)
        busy_elsewhere = _intersection(in_flight, _union(tally.comm_spans + tally.idle_spans))
        tally.overlapped_us = _length(in_flight) - _length(busy_elsewhere)
        return tally, end - start, others
    # CUDA: backward launches from autograd's own thread, so every thread's launches count.
    for thread, events in by_thread.items():
        if thread != main:
            sub = _Tally()
            _walk(_tree(events, start, end), None, None, sub)
            tally.add(sub, times=False)
    mine = [k for k in kernels if k.get("args", {}).get("correlation") in tally.launches]
    end = max([end, *(k["ts"] + k["dur"] for k in mine)])  # the GPU may finish the step after the CPU
    gpu = _Tally()
    _gpu_timeline(mine, tally.launches, start, end, gpu)
    gpu.add(tally, times=False)
    return gpu, end - start, 0.0


def breakdown(trace: dict, top: int = 5) -> Breakdown:
    """The breakdown of every `ProfilerStep#` span in a chrome trace (torch.profiler's
    export_chrome_trace), averaged over them; `top` names per category are kept."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e["name"]).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep# span (profile with a schedule and call step())")
    kernels = [e for e in events if e.get("cat") in _GPU_EVENTS]
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") not in (*_GPU_EVENTS, "Trace") and not e["name"].startswith("ProfilerStep#"):
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    total, wall_us, others_us = _Tally(), 0.0, 0.0
    for step in steps:
        tally, wall, others = _step_tally(step, by_thread, kernels)
        total.add(tally)
        wall_us, others_us = wall_us + wall, others_us + others
    n = len(steps)
    notes = []
    if any(e["name"].startswith("## Call CompiledFxGraph") for e in events) and not any(
            re.search(r"cpp_fused_|triton_", e["name"]) for e in events):
        notes.append("compiled graphs ran without kernel events (set TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1): "
                     "their fused kernels are in idle/other")
    ranked = sorted(total.by_name.items(), key=lambda item: -item[1])
    devices = trace.get("deviceProperties") or []
    return Breakdown(
        timeline="GPU streams" if kernels else "main thread (CPU)", steps=n, step_ms=wall_us / n / 1e3,
        ms={c: total.us[c] / n / 1e3 for c in CATEGORIES},
        matmul_flops=total.matmul_flops / n, attention_flops=total.attention_flops / n,
        compute_dtype=max(total.dtype_flops, key=total.dtype_flops.get) if total.dtype_flops else None,
        device_name=devices[0].get("name") if kernels and devices else None,
        other_threads_ms=others_us / n / 1e3, overlapped_ms=total.overlapped_us / n / 1e3, notes=notes,
        top={c: [(name, us / n / 1e3) for (cat, name), us in ranked if cat == c][:top] for c in CATEGORIES})


def load_breakdown(path: str | Path, top: int = 5) -> Breakdown:
    with open(path) as f:
        return breakdown(json.load(f), top)


def mean_breakdown(parts: list[Breakdown]) -> Breakdown:
    """The mean of several ranks' breakdowns (times, FLOPs and shares alike; the top names are
    the first rank's)."""
    n = len(parts)
    return Breakdown(
        timeline=parts[0].timeline, steps=parts[0].steps, step_ms=sum(p.step_ms for p in parts) / n,
        ms={c: sum(p.ms[c] for p in parts) / n for c in CATEGORIES},
        matmul_flops=sum(p.matmul_flops for p in parts) / n, attention_flops=sum(p.attention_flops for p in parts) / n,
        compute_dtype=parts[0].compute_dtype, device_name=parts[0].device_name,
        other_threads_ms=sum(p.other_threads_ms for p in parts) / n,
        overlapped_ms=sum(p.overlapped_ms for p in parts) / n,
        notes=sorted({note for p in parts for note in p.notes}), top=parts[0].top)
