"""No silent hangs: every rank publishes where it is, and a rank that waits too long says who is stuck.

The trainer builds one Watchdog per rank (`watch_this_rank`) and marks each phase of a step
(`enter("forward/backward", step)`: an attribute write, no communication). A daemon thread per rank publishes a heartbeat (host, pid, step, phase, the
innermost Python frame of the main thread, the time) into the job's c10d store every few seconds.
When this rank's main thread has stayed in one phase longer than the limit (the collective timeout
in force: `comm.init_timeout_seconds` until the first step is done, `comm.train_timeout_seconds`
after it), the thread reads every rank's heartbeat and decides who is stuck:

- a rank whose heartbeat stopped (its process is frozen: SIGSTOP, a node gone, swapped out);
- otherwise the ranks that are behind the others (an earlier step or phase: a rank still loading
  data while its peers wait in a collective);
- otherwise all ranks wait in the same place (a collective that never completes: a network fault).

It then writes the Python stacks of its threads to `<job.dump_folder>/hang_dumps/rank-<r>.txt`
(and, on NCCL, the flight recorder's trace next to them), tells the launcher in one line (the
report folder of torchtitan/runtime/reports.py; the line names the stuck ranks with host and pid, which the
launcher kills), flags the hang in the store so every other waiting rank dumps its stacks at its
next heartbeat too, and ends the process with exit code 5. The process group's own timeout is set
a margin beyond the limit (`collective_timeout`), so this clear report comes first and a gloo
timeout traceback or an NCCL abort only backs it up.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

from torchtitan.errors import EXIT_HANG, Hang
from torchtitan.observability import host_reads
from torchtitan.runtime.reports import reporting_to_folder, write_report

logger = logging.getLogger(__name__)

KEY = "torchtitan/heartbeat/"
HANG_FLAG = "torchtitan/hang"
DUMP_FOLDER = "hang_dumps"
# The order of a step's phases: a rank in an earlier phase of the same step is behind its peers.
PHASES = ("start-up", "data loading", "forward/backward", "gradient norm", "agreeing to go on", "optimizer step",
          "after step", "logging", "checkpoint save")


def collective_timeout(limit_seconds: float) -> float:
    """The process group's timeout for a watchdog limit: far enough beyond it that the watchdog's
    report always comes first, close enough that a job without the watchdog still ends."""
    return limit_seconds + max(30.0, limit_seconds / 4)


def beat_interval(limit_seconds: float) -> float:
    """Heartbeats often enough that a frozen rank is told from a waiting one well within the limit."""
    return min(10.0, max(0.5, limit_seconds / 10))


@dataclass
class Beat:
    rank: int
    host: str
    pid: int
    step: int
    phase: str
    since: float  # wall-clock time the phase began
    at: float  # wall-clock time of this heartbeat
    where: str = ""  # innermost Python frame of the main thread, "function (file:line)"

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def _place(beat: Beat) -> str:
    where = f" at {beat.where}" if beat.where else ""
    return f"{beat.phase} of step {beat.step}{where}" if beat.step else f"{beat.phase}{where}"


def diagnose(beats: dict[int, Beat | None], now: float, limit: float, interval: float,
             dumps: str) -> tuple[str, list[Beat]]:
    """The hang's one line and the stuck ranks' heartbeats, from every rank's newest heartbeat
    (None: the rank never published one)."""
    silent = [r for r, b in beats.items() if b is None]
    stale_after = 3 * interval + 1.0
    frozen = [b for b in beats.values() if b is not None and now - b.at > stale_after]
    alive = [b for b in beats.values() if b is not None and now - b.at <= stale_after]
    hint = (f"Python stacks in {dumps}; if a step can legitimately take this long, raise "
            "comm.train_timeout_seconds (comm.init_timeout_seconds before the first step)")
    if frozen or silent:
        stuck = sorted(frozen, key=lambda b: b.rank)
        parts = [f"{_ranks_text([b.rank])} (host {b.host}, pid {b.pid}) stopped responding: no heartbeat for "
                 f"{now - b.at:.0f} s, last in {_place(b)}" for b in stuck]
        if silent:
            parts.append(f"{_ranks_text(silent)} never sent a heartbeat (did not start, or died at start-up)")
        waiting = alive
    else:
        low = min(b.position for b in alive)
        stuck = sorted((b for b in alive if b.position == low), key=lambda b: b.rank)
        waiting = [b for b in alive if b.position != low]
        if not waiting:  # everyone is in the same place: a collective that never completes
            b = stuck[0]
            where = _place(b)
            return (f"no progress for {now - b.since:.0f} s: every rank waits in {where} "
                    f"(a collective that does not complete: a network fault, or ranks that called different "
                    f"collectives); {hint}"), []
        parts = [f"{_ranks_text([b.rank for b in stuck])} (host {stuck[0].host}, pid "
                 f"{', '.join(str(b.pid) for b in stuck)}) made no progress for {now - stuck[0].since:.0f} s in "
                 f"{_place(stuck[0])}"]
    line = "; ".join(parts)
    if waiting:
        places = sorted({_place(b) for b in waiting})
        line += f"; {_ranks_text([b.rank for b in waiting])} waited in {' / '.join(places)}"
    return f"{line}; {hint}", stuck


class Watchdog:
    """One rank's progress marker, heartbeat and hang detector (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, store, dump_folder: str, limit_seconds: float):
        """`store`: the job's c10d store the heartbeats go through; None for one that only records
        the phase (a single process)."""
        self.rank, self.world_size, self.store = rank, world_size, store
        self.dumps = os.path.join(dump_folder, DUMP_FOLDER)
        self.limit = float(limit_seconds)
        self.step, self.phase, self.since = 0, "start-up", time.time()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new limit takes effect at once, not after the old interval
        self._thread = threading.Thread(target=self._run, name="torchtitan-watchdog", daemon=True)

    def enter(self, phase: str, step: int | None = None) -> None:
        """Marks the start of a phase of the main thread's work (called by the training loop)."""
        if step is not None:
            self.step = step
        self.phase, self.since = phase, time.time()
        host_reads.mark(self.step, phase)  # the host-read audit's step and phase, when one is on

    def set_limit(self, seconds: float) -> None:
        self.limit = float(seconds)
        self._wake.set()

    def start(self) -> Watchdog:
        if self.store is not None:
            self._publish()
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------
    # The watchdog thread

    def _where(self) -> str:
        frame = sys._current_frames().get(self._main)
        if frame is None or threading.get_ident() == self._main:
            return ""
        code = frame.f_code
        return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"

    def _beat(self) -> Beat:
        return Beat(self.rank, self.host, self.pid, self.step, self.phase, self.since, time.time(), self._where())

    def _publish(self) -> None:
        self.store.set(f"{KEY}{self.rank}", json.dumps(asdict(self._beat())))

    def _run(self) -> None:
        while True:
            self._wake.wait(beat_interval(self.limit))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                if self.store.check([HANG_FLAG]):
                    self._end(self.store.get(HANG_FLAG).decode(), [], report=False)
                if time.time() - self.since > self.limit and not self._stop.is_set():
                    self._fire()
            except Exception as e:  # noqa: BLE001 - a store gone with its host: the job is ending anyway
                logger.debug(f"watchdog: {e}")

    def _read(self) -> dict[int, Beat | None]:
        beats: dict[int, Beat | None] = {}
        for r in range(self.world_size):
            key = f"{KEY}{r}"
            beats[r] = Beat(**json.loads(self.store.get(key))) if self.store.check([key]) else None
        return beats

    def _fire(self) -> None:
        line, stuck = diagnose(self._read(), time.time(), self.limit, beat_interval(self.limit), self.dumps)
        line = Hang(line).line
        self.store.set(HANG_FLAG, line)
        self._end(line, stuck, report=True)

    def _end(self, line: str, stuck: list[Beat], report: bool) -> None:
        """Dumps this rank's stacks (and NCCL trace), reports and ends the process."""
        os.makedirs(self.dumps, exist_ok=True)
        with open(os.path.join(self.dumps, f"rank-{self.rank}.txt"), "w") as f:
            f.write(f"rank {self.rank} (host {self.host}, pid {self.pid}) in {self.phase} of step {self.step} "
                    f"since {time.time() - self.since:.1f} s\n{line}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _dump_flight_recorder(os.path.join(self.dumps, f"nccl-trace-rank-{self.rank}.pkl"))
        entries = [{"rank": b.rank, "host": b.host, "pid": b.pid} for b in stuck]
        if not report:
            line = f"error: rank {self.rank} ended because another rank found a hang ({line.removeprefix('error: ')})"
        if reporting_to_folder():
            write_report(self.rank, EXIT_HANG, line, "hang" if report else "aborted", stuck=entries)
        elif report:
            print(line, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_HANG)


def _dump_flight_recorder(path: str) -> None:
    """NCCL's flight recorder (its last collectives per rank, with their states), where the build
    has it (CUDA); `TORCH_NCCL_TRACE_BUFFER_SIZE` (comm.trace_buf_size) must be set before the
    process group starts for it to record anything."""
    try:
        import torch

        from torchtitan.runtime.torch_compat import c10d as torch_compat_c10d

        if not torch.cuda.is_available():
            return
        trace = torch_compat_c10d.dump_nccl_trace()  # before the file is opened: a dump that fails leaves no empty file
        if trace is None:
            return
        with open(path, "wb") as f:
            f.write(trace)
    except Exception as e:  # noqa: BLE001 - a diagnosis must not hide the hang report
        logger.debug(f"flight recorder dump failed: {e}")


def watch_this_rank(rank: int, world_size: int, dump_folder: str, limit_seconds: float) -> Watchdog:
    """This rank's watchdog, started on the default process group's store. A single process has no
    peer to wait for: its watchdog records the phase and nothing watches it."""
    import torch.distributed as dist

    store = None
    if dist.is_initialized() and world_size > 1:
        # Imported here: the seam's c10d module is also what the watchdog's thread reads during a hang.
        from torchtitan.runtime.torch_compat import c10d as torch_compat_c10d

        store = torch_compat_c10d.default_store()
    return Watchdog(rank, world_size, store, dump_folder, limit_seconds).start()
