"""Counts the data-dependent host reads of training steps: every place where the host needs a value
the device computed (`.item()`, `bool(t)`, `.tolist()`, `nonzero`, a boolean-mask index, an
output whose shape depends on the data). On a GPU each one drains the stream up to that point, so
the device idles while the host catches up; on a CPU host and device are one and nothing shows,
but the reads are exactly the same and can be counted here (docs/performance.md, "Host reads").

`HostReadAudit` records them while active: a TorchDispatchMode sees the aten ops that hand a
value or a data-dependent shape to the host, and `Tensor.tolist`/`numpy` are wrapped because on
a CPU tensor they read memory without dispatching any op. Each read keeps the innermost source
line in this package and the training phase it happened in (`mark`, called by the trainer's
instruments), so a report says which step and which phase read what, from where.

A read of a host copy made earlier without waiting (`deferred`: the trainer's one-step-late
agreement, see trainer/agreement.py) is recorded as such and is not a stall: on CUDA it waits for
an event recorded a step earlier, not for the stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

from torchtitan.runtime.torch_compat.dispatch import (
    BOOLEAN_MASK_OPS,
    HOST_READ_OPS,
    REPEAT_INTERLEAVE_OPS,
    FakeTensor,
    TorchDispatchMode,
    tree_leaves,
)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # torchtitan/
_THIS_FILE = os.path.abspath(__file__)
_ROOT = os.path.dirname(_PACKAGE)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


# The message of PyTorch's CUDA sync debug mode (torch.cuda.set_sync_debug_mode).
_CUDA_SYNC = r"called a synchronizing CUDA operation"


def _boolean_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


@dataclass
class HostRead:
    op: str  # item, tolist, nonzero, ...
    where: str  # the innermost source line in this package: "torchtitan/trainer/loop.py:279 nonfinite"
    step: int | None  # the training step it happened in (None: outside the training loop)
    phase: str | None  # the phase of that step ("forward/backward", "logging", ...)
    deferred: bool = False  # a read of a host copy made a step earlier (waits on no stream)
    scheduled: bool = False  # on a step that reads anyway: it logs, saves, validates, stops or is the last


def _where() -> str:
    """The innermost frame of this package (outside this file) on the current stack; for code
    outside the package (tests, scripts), the innermost frame outside torch."""
    stack = traceback.extract_stack()
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE + os.sep) and path != _THIS_FILE:
            return f"{os.path.relpath(path, _ROOT)}:{frame.lineno} {frame.name}"
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH + os.sep) and path != _THIS_FILE:
            return f"{os.path.basename(path)}:{frame.lineno} {frame.name}"
    return "unknown"


class HostReadAudit(TorchDispatchMode):
    """Records the host reads of the main thread while entered (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.reads: list[HostRead] = []
        self.step: int | None = None
        self.phase: str | None = None
        self._deferred = self._scheduled = 0
        self._thread = threading.get_ident()
        self._patched: dict[str, Any] = {}
        self._sync_mode: int | None = None  # CUDA's sync debug mode before this audit (CUDA only)

    # -- what the trainer tells it -------------------------------------------------------------

    def mark(self, step: int | None, phase: str) -> None:
        self.step, self.phase = step, phase

    def deferred_read(self) -> contextlib.AbstractContextManager:
        return self._counting("_deferred")

    def scheduled_read(self) -> contextlib.AbstractContextManager:
        return self._counting("_scheduled")

    @contextlib.contextmanager
    def _counting(self, attribute: str) -> Iterator[None]:
        """Marks the reads inside (nesting counts, so an inner exit keeps an outer mark)."""
        setattr(self, attribute, getattr(self, attribute) + 1)
        try:
            yield
        finally:
            setattr(self, attribute, getattr(self, attribute) - 1)

    # -- recording -----------------------------------------------------------------------------

    def _record(self, op: str) -> None:
        if threading.get_ident() != self._thread:
            return  # a background thread's (an async checkpoint writer): not on the step's path
        self.reads.append(HostRead(op, _where(), self.step, self.phase, self._deferred > 0, self._scheduled > 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # `types`: the tensor subclasses among the arguments (cheaper than walking them every op).
        if any(issubclass(t, DTensor) for t in types):
            # Handing a DTensor op on keeps this mode active inside DTensor's own dispatch, so the
            # local ops it runs (a vocabulary-sharded embedding's mask, a redistribution) are seen
            # and counted there, once.
            return NotImplemented
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # sharding propagation's metadata: no data to read
        name = HOST_READ_OPS.get(func)
        if name is None and func in REPEAT_INTERLEAVE_OPS and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        if name is None and func in BOOLEAN_MASK_OPS and _boolean_mask(args[1] if len(args) > 1 else kwargs.get("indices")):
            name = "boolean mask"
        if name is not None and not self._in_host_memory(tree_leaves((args, kwargs))):
            self._record(name)
        return func(*args, **kwargs)

    def _in_host_memory(self, tensors: list) -> bool:
        """On a GPU run, whether the op reads only host tensors (the foreach optimizers' step counts,
        the gloo agreements): those wait for no stream. A CPU run cannot tell them apart."""
        if self._sync_mode is None:
            return False
        return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))

    def __enter__(self):
        global _ACTIVE
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def wrapped(tensor, *args, __original=original, __name=method, **kwargs):
                if not self._in_host_memory([tensor]):
                    self._record(__name)
                return __original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, wrapped)
        self._watch_cuda_syncs()
        _ACTIVE = self
        return super().__enter__()

    def _watch_cuda_syncs(self) -> None:
        """On CUDA, CUDA's own count as well: PyTorch's sync debug mode warns at every call that
        waits for the stream (a blocking copy to the host, a stream or device synchronize), also
        those this mode cannot see (inside C++ kernels). Each warning is recorded as a "cuda sync"
        read; waiting for an event (the deferred agreement) is not one."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self._sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self._filters = warnings.filters[:]
        warnings.filterwarnings("always", message=_CUDA_SYNC)  # every one, not once per line
        self._showwarning = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if re.search(_CUDA_SYNC, str(message)):
                self._record("cuda sync")
            else:
                self._showwarning(message, category, filename, lineno, file, line)

        warnings.showwarning = show

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        if self._sync_mode is not None:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            warnings.filters[:] = self._filters
            warnings.showwarning = self._showwarning
            self._sync_mode = None
        return super().__exit__(*exc)

    # -- reporting -----------------------------------------------------------------------------

    def stalls(self) -> list[HostRead]:
        """The reads that wait on the device (all but the deferred ones)."""
        return [r for r in self.reads if not r.deferred]

    def steady_state(self, first_step: int) -> list[HostRead]:
        """The stalls of steady-state training: in steps after `first_step` (whose first run of
        each op initialises lazily), except the work the trainer marks as done only on its own
        schedule (`scheduled_read`: step lines, checkpoint saves, validation, the last step)."""
        return [r for r in self.stalls() if r.step is not None and r.step > first_step and not r.scheduled]

    def per_step(self) -> dict[int | None, int]:
        return dict(Counter(r.step for r in self.stalls()))

    def report(self, first_step: int) -> dict[str, Any]:
        steady = self.steady_state(first_step)
        steps = sorted(s for s in {r.step for r in self.reads} if s is not None)
        return {
            "first_step": first_step,
            "steps_seen": steps,
            "stalls": len(self.stalls()),
            "deferred": sum(r.deferred for r in self.reads),
            "scheduled": sum(r.scheduled for r in self.stalls()),
            "steady_state": len(steady),
            "cuda_syncs": sum(r.op == "cuda sync" for r in self.reads),
            "steady_state_cuda_syncs": sum(r.op == "cuda sync" for r in steady),
            "steady_state_by_line": dict(Counter(f"{r.op} {r.where} ({r.phase})" for r in steady)),
            "by_phase": dict(Counter(f"{r.phase}" for r in self.stalls())),
            "per_step": {str(k): v for k, v in self.per_step().items()},
            "reads": [asdict(r) for r in self.reads],
        }


_ACTIVE: HostReadAudit | None = None


def mark(step: int | None, phase: str) -> None:
    """Tells the active audit (if any) which step and phase the host is in now."""
    if _ACTIVE is not None:
        _ACTIVE.mark(step, phase)


def waited(what: str) -> None:
    """Records a wait for the device that no op shows (a CUDA event's synchronize)."""
    if _ACTIVE is not None:
        _ACTIVE._record(what)


def deferred_read() -> contextlib.AbstractContextManager:
    """Wraps a read of a host copy made without waiting (not a stall)."""
    return _ACTIVE.deferred_read() if _ACTIVE is not None else contextlib.nullcontext()


def scheduled_read() -> contextlib.AbstractContextManager:
    """Wraps a read that happens only on steps that read anyway (not steady state)."""
    return _ACTIVE.scheduled_read() if _ACTIVE is not None else contextlib.nullcontext()


@contextlib.contextmanager
def maybe_audit(enabled: bool, path: str, first_step: int, log: Any = None) -> Iterator[HostReadAudit | None]:
    """Audits the training loop when `enabled` (profiling.audit_host_reads): writes the report to
    `path` (JSON) and logs one line with the steady-state count."""
    if not enabled:
        yield None
        return
    audit = HostReadAudit()
    try:
        with audit:
            yield audit
    finally:
        report = audit.report(first_step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        if log is not None:
            lines = "; ".join(f"{n}x {line}" for line, n in report["steady_state_by_line"].items())
            log(f"host reads: {report['steady_state']} in steady-state steps, {report['stalls']} in all "
                f"({report['scheduled']} on the steps that log, save or validate), {report['deferred']} deferred; {path}"
                + (f"; steady-state: {lines}" if lines else ""))
