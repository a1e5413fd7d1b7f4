"""How a rank says how it ended, and how the launcher tells the job's root cause from them.

A single process prints its own line. Under a launcher (`run_llama_train.sh` through
`torchtitan.runtime.launch`, or the test suite's forking one) every rank instead writes how it ended into
the job's report folder (`$TORCHTITAN_REPORT_DIR`), and the launcher prints the root cause once,
whichever rank found it: errors found only on rank 1 (its data shard, its memory) are not lost,
and an error found by every rank is not printed once per rank. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

from torchtitan.errors import EXIT_BUG, Preempted, RunEnded, Stopped, out_of_memory

REPORT_DIR_ENV = "TORCHTITAN_REPORT_DIR"


@dataclass
class Report:
    """How one rank ended, as written into the report folder."""

    rank: int
    code: int
    line: str
    kind: str  # "error" (one line), "bug" (a traceback), "stopped", "aborted" (collateral of a stop)
    traceback: str = ""
    time: float = 0.0
    attempt: int = 0  # torchrun's restart count (TORCHELASTIC_RESTART_COUNT) when the rank wrote it
    stuck: list = field(default_factory=list)  # a hang's stuck ranks: {"rank", "host", "pid"}


def attempt() -> int:
    """Which start of the job this process belongs to: 0, then 1 after torchrun's first restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def reporting_to_folder() -> bool:
    return bool(os.environ.get(REPORT_DIR_ENV))


def write_report(rank: int, code: int, line: str, kind: str, tb: str = "", stuck: list | None = None) -> None:
    """Records how this rank ended in the launcher's report folder (written whole, then renamed,
    so the launcher never reads half a report). A folder that cannot take it (missing, full, gone
    with a launcher that ended first) gets the rank to print its ending itself instead."""
    folder = os.environ[REPORT_DIR_ENV]
    report = Report(rank, code, line, kind, tb, time.time(), attempt(), stuck or [])
    suffix = f".attempt-{report.attempt}" if report.attempt else ""
    path = os.path.join(folder, f"rank-{rank}{suffix}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(report), f)
        os.replace(path + ".tmp", path)
    except OSError:
        print(tb.rstrip() if kind == "bug" else line, file=sys.stderr, flush=True)


def mark_attempt() -> None:
    """Records in the report folder that this start of the job began (a restart's ranks may all
    finish without a report, which must not leave the failed attempt's reports as the ending)."""
    if reporting_to_folder() and attempt():
        with open(os.path.join(os.environ[REPORT_DIR_ENV], f"attempt-{attempt()}"), "a"):
            pass


def attempts_started(folder: str) -> int:
    """How many times torchrun restarted the job's ranks, as far as the report folder shows."""
    names = [n for n in os.listdir(folder) if n.startswith("attempt-")]
    return max((int(n.removeprefix("attempt-")) for n in names if n.removeprefix("attempt-").isdigit()), default=0)


def read_reports(folder: str) -> list[Report]:
    """The reports of the newest attempt (after torchrun restarts, the earlier attempts' endings
    were recovered from and no longer explain the job)."""
    reports = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    reports.append(Report(**json.load(f)))
            except (OSError, ValueError, TypeError):
                continue  # a rank killed while writing; its exit code still counts below
    newest = max([attempts_started(folder), *(r.attempt for r in reports)])
    return [r for r in reports if r.attempt == newest]


# Which ending explains a job best: a rank's own error or bug over a stop, and a stop over the
# errors that ranks hit only because a peer had already gone.
_PRIORITY = {"error": 0, "bug": 0, "hang": 0, "stopped": 1, "preempted": 1, "aborted": 2}


def summarize(reports: list[Report], exit_codes: dict[int, int], signum: int = 0) -> tuple[int, str]:
    """The job's exit code and what to print for it, from the ranks' reports, the exit codes of
    ranks that failed (rank -> code) and the signal the launcher received, if any. The root cause
    is the first report written among the most telling kind: a rank's error is written before it
    exits, so before its peers notice it gone and fail in their turn."""
    if reports:
        first = min(reports, key=lambda r: (_PRIORITY.get(r.kind, 0), r.time, r.rank))
        if first.kind == "bug":
            return first.code, f"rank {first.rank} failed with an unexpected error (a bug):\n{first.traceback.rstrip()}"
        reported = {r.rank for r in reports}
        if first.kind != "aborted" or signum or not any(c and r not in reported for r, c in exit_codes.items()):
            return first.code, first.line
        # Only collateral endings were reported, and no signal reached the launcher: the cause is
        # a rank that ended without a word (killed from outside), which torchrun's tear-down or
        # its lost connections made the others report.
        exit_codes = {r: c for r, c in exit_codes.items() if r not in reported}
    if signum:
        return 128 + signum, (f"stopped: {signal.Signals(signum).name} received; the ranks were ended before they "
                              "reached a step boundary (during start-up, or by a second signal)")
    failed = {rank: code for rank, code in exit_codes.items() if code != 0}
    if not failed:
        return 0, ""
    # A rank that exited by itself failed first; ranks ended by a signal were usually stopped
    # by the launcher because of it.
    rank = min(failed, key=lambda r: (failed[r] < 0, r))
    code = failed[rank]
    if code < 0:  # a killed process wrote nothing more: its output cannot say why, the host's log may
        return 128 - code, (f"error: rank {rank} ended with signal {signal.Signals(-code).name} without saying why "
                            "(killed from outside, or out of host memory? the kernel's log, dmesg, names what the "
                            "out-of-memory killer ended)")
    return code, (f"error: rank {rank} ended with exit code {code} without saying why; rerun with LOG_RANK={rank} "
                  "to see its output")


# What gloo and NCCL say when a peer of a collective is gone (killed, crashed, its node lost).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted")


def lost_peer(exc: BaseException) -> bool:
    return any(m in str(exc) for m in _PEER_LOST)


def say_how_it_ended(rank: int, exc: BaseException, stop_requested: int = 0) -> int:
    """Tells how this rank ended (in the report folder, or as one line on stderr) and returns the
    exit code. A bug is re-raised when no launcher collects reports, so that Python prints its
    one traceback; under a launcher the traceback goes into the report and the launcher prints it."""
    ended = exc if isinstance(exc, RunEnded) else out_of_memory(exc)
    kind = "preempted" if isinstance(ended, Preempted) else "stopped" if isinstance(ended, Stopped) else "error"
    if ended is None and not stop_requested and lost_peer(exc):
        # Another rank is gone (on another node, its launcher reports why): not this rank's bug.
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        line = (f"error: rank {rank} lost a peer in a collective ({first}); the rank that failed first is reported by "
                "the launcher of its node")
        kind, code = "aborted", EXIT_BUG
    elif ended is None and stop_requested:
        # A stop was under way when this failed: a peer that stopped first is gone from a collective.
        name = signal.Signals(stop_requested).name
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        ended, kind = Stopped(stop_requested, None), "aborted"
        line = f"stopped: {name} received; the step under way did not finish (a peer was ended first: {first})"
        code = ended.exit_code
    elif ended is not None:
        line, code = ended.line, ended.exit_code
    elif reporting_to_folder():
        write_report(rank, EXIT_BUG, "", "bug", format_traceback(exc))
        return EXIT_BUG
    else:
        raise exc
    if reporting_to_folder():
        write_report(rank, code, line, kind)
    else:
        print(line, file=sys.stderr, flush=True)
    return code


def format_traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
