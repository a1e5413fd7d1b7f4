"""The collectives a rank called in one profiled step, by kind, read from its PyTorch profiler trace.

With `profiling.enable_profiling` (record_shapes on) every process-group call a rank makes is a
dispatcher op in its chrome trace, on the thread that called it: `c10d::_allgather_base_`,
`c10d::allreduce_`, `c10d::alltoall_base_`, `c10d::send`, ..., and DTensor's functional collectives
(`_c10d_functional::all_gather_into_tensor`, ...) around the c10d op they issue. Each outermost
such op is one call. (PyTorch records `record_param_comms` events, with the group size, for NCCL
only; gloo's collectives appear as these ops, which is all this reader needs.)

Its payload follows torchtitan/estimation/step_time.py's convention: the output of an all-gather,
the input of a reduce-scatter, the tensor of an all-reduce, the input of an all-to-all, the tensor
of a send or a receive. Shapes come from the ops' `Input Dims`; an op whose tensors are a list
records no dtype (`TensorList`), which is then taken from the functional op around it, or from the
backend's own span of the work (`gloo:all_reduce`, ..., on gloo's threads, with the tensor's dtype)
of the same shape that starts next. The list form of all-gather (`dist.all_gather` into a list of
tensors) records its input only: its output is taken as the input times `world` ranks (the
trainer's one such call, the step line's straggler report, spans the world).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
# Process-group ops by kind, and which argument holds the payload (0 first, 1 second).
C10D_OPS = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", None),  # the list form: input times the world (docstring)
    "c10d::allgather_coalesced_": ("all_gather", None),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "c10d::send": ("send_recv", 0),
    "c10d::recv_": ("send_recv", 0),
    "c10d::recv_any_source_": ("send_recv", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::reduce_": ("reduce", 0),
    "c10d::gather_": ("gather", 1),
    "c10d::scatter_": ("scatter", 0),
    "c10d::barrier": ("barrier", None),
}
FUNCTIONAL_PREFIXES = ("_c10d_functional::", "c10d_functional::", "_c10d_functional_autograd::")
# Functional ops that wait or wrap rather than communicate.
NOT_CALLS = ("wait_tensor", "_wrap_tensor_autograd")
BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "short int": 2,
         "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def _numel(dims) -> int:
    """Elements of a recorded shape, or of a list of shapes (a TensorList)."""
    if isinstance(dims, list) and dims and isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    return math.prod(dims) if isinstance(dims, list) else 0


def _first_shape(dims):
    while isinstance(dims, list) and dims and isinstance(dims[0], list):
        dims = dims[0]
    return dims


def _kind(name: str) -> str | None:
    if name in C10D_OPS:
        return C10D_OPS[name][0]
    if name.startswith(FUNCTIONAL_PREFIXES) and not name.endswith(NOT_CALLS):
        op = name.split("::", 1)[1]
        for word, kind in (("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                           ("all_reduce", "all_reduce"), ("all_to_all", "all_to_all"), ("broadcast", "broadcast")):
            if op.startswith(word):
                return kind
        return "other"
    return None


def calls(trace: dict, world: int) -> list[dict]:
    """Every collective call of the trace: {"kind", "op", "bytes", "dtype", "ts"}, in time order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    comm = sorted((e for e in events if _kind(e["name"]) is not None), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    backend = sorted((e for e in events if e["name"].startswith(("gloo:", "nccl:"))), key=lambda e: e["ts"])
    claimed: set[int] = set()
    found, outer = [], None
    for e in comm:
        if outer is not None and e["tid"] == outer["tid"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]:
            outer["inner"].append(e)  # issued by the call around it
            continue
        outer = {**e, "inner": []}
        found.append(outer)
    return sorted((_call(c, world, backend, claimed) for c in found), key=lambda c: c["ts"])


def _call(outer: dict, world: int, backend: list[dict], claimed: set[int]) -> dict:
    c10d = next((e for e in [outer, *outer["inner"]] if e["name"] in C10D_OPS), None)
    kind = _kind(outer["name"]) if c10d is None else C10D_OPS[c10d["name"]][0]
    source = c10d if c10d is not None else outer
    args = source.get("args", {})
    dims, types = args.get("Input Dims", []), args.get("Input type", [])
    position = C10D_OPS[source["name"]][1] if c10d is not None else 0
    if c10d is not None and position is None:  # the list form: the input list (docstring)
        shape, dtype_name, factor = (dims[1] if len(dims) > 1 else []), "TensorList", world
    else:
        shape = dims[position] if len(dims) > position else []
        dtype_name, factor = (types[position] if len(types) > position else ""), 1
        if c10d is None and kind == "all_gather":  # a functional all-gather's input, times its group
            factor = int((args.get("Concrete Inputs") or ["", "1"])[1] or 1)
    if dtype_name not in BYTES:
        dtype_name = _dtype_around(outer, shape, backend, claimed)
    return {"kind": kind, "op": source["name"], "ts": outer["ts"], "dtype": dtype_name,
            "bytes": _numel(shape) * factor * BYTES.get(dtype_name, 4)}


def _dtype_around(outer: dict, shape, backend: list[dict], claimed: set[int]) -> str:
    """A TensorList op's dtype: the functional op's around it, else the next backend span of the
    same shape (docstring); float when neither is found."""
    args = outer.get("args", {})
    types = args.get("Input type", [])
    if outer["name"].startswith(FUNCTIONAL_PREFIXES) and types and types[0] in BYTES:
        return types[0]
    want = _first_shape(shape)
    for i, e in enumerate(backend):
        if i in claimed or e["ts"] < outer["ts"]:
            continue
        recorded = e.get("args", {})
        if _first_shape(recorded.get("Input Dims", [])) == want and (recorded.get("Input type") or [""])[0] in BYTES:
            claimed.add(i)
            return recorded["Input type"][0]
    return "float"


def by_kind(trace_calls: list[dict]) -> dict[str, dict[str, float]]:
    """Calls and bytes of each kind (every one of KINDS present; others, such as broadcasts, too)."""
    table = {kind: {"count": 0.0, "bytes": 0.0} for kind in KINDS}
    for c in trace_calls:
        row = table.setdefault(c["kind"], {"count": 0.0, "bytes": 0.0})
        row["count"] += 1
        row["bytes"] += c["bytes"]
    return table


def read_rank_traces(paths: list[Path]) -> list[dict[str, dict[str, float]]]:
    """Each rank's calls by kind, from its trace file (the ranks of one job, so `world` is their number)."""
    return [by_kind(calls(json.loads(Path(p).read_text()), len(paths))) for p in paths]


def mean_over_ranks(tables: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The per-rank mean of each kind's calls and bytes."""
    kinds = list(dict.fromkeys(k for t in tables for k in t))
    return {k: {field: sum(t.get(k, {}).get(field, 0.0) for t in tables) / len(tables) for field in ("count", "bytes")}
            for k in kinds}
