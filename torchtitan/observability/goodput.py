"""Goodput: where a run's wall clock went, and what share of it trained steps that were kept.

Each rank keeps a `Goodput` ledger from its launch (or its process's start) to its summary, in
categories that sum to that wall time: start-up, checkpoint load, compilation and warm-up (the first
step's time beyond a steady step), checkpoint save (its blocking part), data waiting, validation,
and what is left: productive training. Rank 0 also appends the ledger to
`<dump_folder>/goodput.jsonl`, an attempt row when a run starts and a progress row at every log
step, checkpoint save and at the end. A later attempt of the same job (torchrun's restart, or a
launch that resumes a checkpoint) reads the file to add what only the job sees: the gaps between
attempts (restarts) and the productive time spent on steps after the checkpoint it resumed from,
trained again (redone). docs/operations.md, "Goodput", says how to read the figures.

Nothing here imports torch: train.py imports this module before torch, so that the process's
clock starts before the imports it counts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from torchtitan.observability.metric_files import JsonRowsFile
from torchtitan.observability.progress import duration
from torchtitan.runtime.reports import attempt as torchrun_restart

logger = logging.getLogger(__name__)

LAUNCH_TIME_ENV = "TORCHTITAN_LAUNCH_TIME"  # set by runtime/launch.py: when the launcher started (Unix seconds)
FILE_NAME = "goodput.jsonl"
# A run's categories, in the order the summary line gives them; they sum to its wall time.
CATEGORIES = ("productive", "startup", "compilation", "checkpoint_save", "checkpoint_load", "data_waiting",
              "validation")
# What only a job of several attempts has besides: gaps between attempts and productive time lost.
JOB_CATEGORIES = (*CATEGORIES, "restarts", "redone")
# Work beside the steps' own, inside the training loop: measured where it happens, kept out of the
# steps' productive time and out of the compilation estimate.
_BESIDE_STEPS = ("checkpoint_save", "data_waiting", "validation")

_process_start: float | None = time.time()


def _forked() -> None:
    # A forked child (the test suite's warm launcher forks its ranks from a process that imported
    # the trainer long before) starts now, without the imports it inherited.
    global _process_start
    _process_start = time.time()


os.register_at_fork(after_in_child=_forked)


def run_start() -> float:
    """When this process's run began (Unix seconds): the process's start for the first run, so that
    the imports count; the call itself for a later run in the same process (tests that call
    train() again), whose imports were paid before."""
    global _process_start
    started, _process_start = _process_start, None
    return started if started is not None else time.time()


def launch_time() -> float | None:
    """When the launcher (runtime/launch.py) started, for a rank of the launch's first attempt; None
    without the launcher, and for torchrun's restarts, whose launcher started before the failed
    attempts (the gap is then the job's, under restarts)."""
    value = os.environ.get(LAUNCH_TIME_ENV, "")
    if torchrun_restart() or not value.replace(".", "", 1).isdigit():
        return None
    return float(value)


class GoodputFile(JsonRowsFile):
    """goodput.jsonl of rank 0, appended; a write that fails stops it with one warning, never the
    run (metric_files.py says why)."""

    what = "goodput file"

    def __init__(self, path: str, new_job: bool):
        super().__init__(path)

        def open_it() -> None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if new_job:
                _set_aside(path)
            self.file = open(path, "a")
            if self.file.tell() > 0:
                with open(path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # the half-written row of a killed attempt: ours starts a line
                        self.file.write("\n")

        self._guarded("at start-up", open_it)


def _set_aside(path: str) -> None:
    """A new job in a used dump folder keeps the earlier job's file as goodput.<n>.jsonl, as a fresh
    run does with metrics.jsonl."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    root, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{root}.{n}{ext}"):
        n += 1
    os.replace(path, f"{root}.{n}{ext}")
    logger.info(f"{path} holds an earlier job's goodput: renamed it to {root}.{n}{ext}; this job starts a new one")


@dataclass
class Attempt:
    """One start of a job as goodput.jsonl keeps it: when its clock started (Unix seconds: its
    launch, or its process's start), the step it resumed from, and its progress rows as (step,
    time, cumulative seconds per category)."""

    start: float
    resumed_step: int
    rows: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)

    @property
    def last_time(self) -> float:
        # Without a progress row nothing of the attempt is accounted: its whole span falls into the
        # gap before the next attempt (restarts), so the job's categories still sum to its wall time.
        return self.rows[-1][1] if self.rows else self.start

    @property
    def last_seconds(self) -> dict[str, float]:
        return self.rows[-1][2] if self.rows else {}

    def productive_kept_at(self, step: int) -> float:
        """The productive seconds of this attempt that survive a resume from `step`: none when it
        resumed at or after `step`; else its last productive figure less the step time it spent
        after `step`. That time is read from the net step seconds (productive + compilation) of its
        last row and of its last row at or below `step`: unlike productive alone, their sum does
        not move as the compilation estimate is refined. Rows come at log steps and checkpoint
        saves, so a checkpoint's step has its row unless its write failed; a row below it counts the
        steps between as redone, which they were not (the job's figure errs low)."""
        if step <= self.resumed_step or not self.rows:
            return 0.0
        kept = [_net(seconds) for row_step, _, seconds in self.rows if row_step <= step]
        lost = _net(self.last_seconds) - (kept[-1] if kept else 0.0)
        return max(0.0, self.last_seconds["productive"] - lost)


def _net(seconds: dict[str, float]) -> float:
    return seconds["productive"] + seconds.get("compilation", 0.0)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_attempts(path: str) -> list[Attempt]:
    """The attempts goodput.jsonl holds, oldest first. Lines that do not parse (a row half-written
    when an attempt was killed, or an edited file) are left out with one warning; a file that cannot
    be read at all counts as none, with one warning: the job's figure then starts with this attempt."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        logger.warning(f"cannot read {path} ({e.strerror or e}): the job's goodput counts from this attempt on")
        return []
    attempts: list[Attempt] = []
    skipped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        kind = row.get("record") if isinstance(row, dict) else None
        if kind == "attempt" and _number(row.get("start")) and _number(row.get("resumed_step")):
            attempts.append(Attempt(float(row["start"]), int(row["resumed_step"])))
        elif (kind == "progress" and attempts and _number(row.get("step")) and _number(row.get("time"))
              and isinstance(row.get("seconds"), dict) and _number(row["seconds"].get("productive"))):
            seconds = {k: float(v) for k, v in row["seconds"].items() if _number(v)}
            attempts[-1].rows.append((int(row["step"]), float(row["time"]), seconds))
        else:
            skipped += 1
    if skipped:
        logger.warning(f"{path}: left out {skipped} line{'s' if skipped > 1 else ''} that {'are' if skipped > 1 else 'is'} "
                       "not a goodput row (half-written by a killed attempt, or edited); the job's figures go without")
    return attempts


def job_split(attempts: list[Attempt]) -> dict[str, float]:
    """The job's wall time, from the first attempt's start to the last attempt's last row, split
    into JOB_CATEGORIES (they sum to it, under "wall"). Each attempt's categories are those of its
    last row; `restarts` are the gaps between one attempt's last row and the next one's start;
    `productive` counts only what survives: an attempt resuming from step r makes every earlier
    attempt's productive time after step r `redone`."""
    totals = dict.fromkeys(JOB_CATEGORIES, 0.0)
    surviving: list[float] = []
    for k, current in enumerate(attempts):
        if k:
            totals["restarts"] += max(0.0, current.start - attempts[k - 1].last_time)
            for j, earlier in enumerate(attempts[:k]):
                kept = min(surviving[j], earlier.productive_kept_at(current.resumed_step))
                totals["redone"] += surviving[j] - kept
                surviving[j] = kept
        surviving.append(current.last_seconds.get("productive", 0.0))
        for category in CATEGORIES[1:]:
            totals[category] += current.last_seconds.get(category, 0.0)
    totals["productive"] = sum(surviving)
    totals["wall"] = attempts[-1].last_time - attempts[0].start if attempts else 0.0
    return totals


def percent(split: dict[str, float]) -> float:
    return 100 * split["productive"] / split["wall"] if split["wall"] > 0 else 0.0


class Goodput:
    """One rank's ledger of a run. `started`: when the process began (Unix seconds); `launched`:
    when its launcher did (its clock then starts there: rendezvous and spawn count as start-up).
    Durations are measured on the monotonic clock; only the starts and the rows' times, compared
    across processes and attempts, are Unix times."""

    def __init__(self, started: float | None = None, launched: float | None = None):
        wall, now = time.time(), time.perf_counter()
        self.created = now  # train()'s start, where the progress line's elapsed time counts from
        self.process_start = wall if started is None else started
        self.launched = launched if launched is not None and launched <= self.process_start else None
        self.start = self.launched if self.launched is not None else self.process_start
        self._begin = now - (wall - self.start)  # the run's start on the monotonic clock
        self._last_mark = now - (wall - self.process_start)
        # Start-up phases in wall seconds, in the order they ran (the setup record's `startup`).
        self.phases: dict[str, float] = {}
        if self.launched is not None:
            self.phases["rendezvous_and_spawn"] = self.process_start - self.launched
        self.seconds = dict.fromkeys(("checkpoint_load", *_BESIDE_STEPS), 0.0)
        self._loop_began: float | None = None
        self._startup = 0.0
        self._step_end = 0.0
        self._beside_at_step_end = 0.0
        self._first_step: tuple[float, float] | None = None  # (wall seconds, seconds net of the work beside it)
        self._steady_seconds, self._steady_steps = 0.0, 0
        # Rank 0's job file: this attempt's number in it and the earlier attempts it holds.
        self.file: GoodputFile | None = None
        self.attempt = 0
        self.earlier: list[Attempt] = []
        self.current = Attempt(self.start, 0)  # this attempt as the job's figure counts it

    @classmethod
    def of_this_process(cls) -> Goodput:
        """The ledger of the run this process starts now; the imports are its first phase."""
        ledger = cls(run_start(), launch_time())
        ledger.mark("imports")
        return ledger

    # ------------------------------------------------------------------------------------------
    # What the build sequence and the training loop report

    def mark(self, phase: str) -> None:
        """Start-up phase `phase` ended now (it began where the previous one ended)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last_mark
        if phase == "checkpoint_load":
            self.seconds["checkpoint_load"] += now - self._last_mark
        self._last_mark = now

    @contextlib.contextmanager
    def counting(self, category: str | None) -> Iterator[None]:
        """Counts the time inside under `category` (None: counts nothing)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if category is not None:
                self.seconds[category] += time.perf_counter() - start

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def loop_started(self) -> None:
        """The training loop begins: start-up ends here, less what was counted apart meanwhile
        (the checkpoint load, a validation a resumed step missed)."""
        now = time.perf_counter()
        self.mark("before_first_step")
        self._loop_began = self._step_end = now
        self._beside_at_step_end = self._beside()
        self._startup = now - self._begin - sum(self.seconds.values())

    def step_done(self) -> None:
        """A step ended. Its time net of the work beside it (data, saves, validation: counted apart)
        is the first step's, or one more steady step's for the compilation estimate."""
        now, beside = time.perf_counter(), self._beside()
        net = (now - self._step_end) - (beside - self._beside_at_step_end)
        if self._first_step is None:
            self._first_step = (now - self._step_end, net)
        else:
            self._steady_seconds += net
            self._steady_steps += 1
        self._step_end, self._beside_at_step_end = now, beside

    def _beside(self) -> float:
        return sum(self.seconds[c] for c in _BESIDE_STEPS)

    # ------------------------------------------------------------------------------------------
    # The figures

    def compilation(self) -> float:
        """Compilation and warm-up: the first step's net time beyond the mean of the later steps'
        (0 until a later step ran: one step alone cannot tell its warm-up from its work)."""
        if self._first_step is None or not self._steady_steps:
            return 0.0
        return max(0.0, self._first_step[1] - self._steady_seconds / self._steady_steps)

    def split(self) -> dict[str, float]:
        """This run's wall time so far, under "wall", and its CATEGORIES, which sum to it."""
        wall = time.perf_counter() - self._begin
        if self._loop_began is None:  # still starting up (or nothing was left to train)
            startup, compilation = wall - sum(self.seconds.values()), 0.0
        else:
            startup, compilation = self._startup, self.compilation()
        productive = max(0.0, wall - startup - compilation - sum(self.seconds.values()))
        return {"productive": productive, "startup": startup, "compilation": compilation, **self.seconds, "wall": wall}

    def percent(self) -> float:
        """This run's goodput so far: productive seconds per wall second, in percent."""
        return percent(self.split())

    def startup_phases(self) -> dict[str, float]:
        """The start-up phases' wall seconds; `first_step` runs from the loop's start to now while
        the first step is under way (the setup record is written after its update)."""
        phases = dict(self.phases)
        if self._loop_began is not None:
            phases["first_step"] = (self._first_step[0] if self._first_step is not None
                                    else time.perf_counter() - self._loop_began)
        return phases

    # ------------------------------------------------------------------------------------------
    # The job file (rank 0)

    def join_job(self, dump_folder: str, resumed_step: int, write: bool) -> None:
        """Appends this attempt to the job's goodput.jsonl (`write`: rank 0 only), after reading the
        earlier attempts. A run from step 0 that is not torchrun's restart starts a new job (an
        earlier job's file is set aside); any other run continues the job in the folder: a restart,
        or a launch that resumes a checkpoint (a preempted job launched again)."""
        if not write:
            return
        path = os.path.join(dump_folder, FILE_NAME)
        new_job = resumed_step == 0 and not torchrun_restart()
        self.earlier = [] if new_job else read_attempts(path)
        if not new_job and not self.earlier:
            logger.warning(f"{path} holds no earlier attempt of this job although this run resumes step {resumed_step}: "
                           "the job's goodput counts from this attempt on")
        self.attempt = len(self.earlier)
        self.current.resumed_step = resumed_step
        self.file = GoodputFile(path, new_job)
        self.file.write({"record": "attempt", "attempt": self.attempt, "torchrun_restart": torchrun_restart(),
                         "start": self.start, "process_start": self.process_start, "launch_time": self.launched,
                         "resumed_step": resumed_step, "time": round(time.time(), 3)}, None)

    def note(self, step: int, ended: str | None = None) -> dict[str, float]:
        """A progress row after `step` (at a log step, a save, and the end: `ended`); returns the split."""
        split = self.split()
        if self.file is not None:
            now = time.time()
            seconds = {k: round(v, 3) for k, v in split.items() if k != "wall"}
            row = {"record": "progress", "attempt": self.attempt, "step": step, "time": round(now, 3), "seconds": seconds}
            self.file.write({**row, "ended": ended} if ended else row, step)
            self.current.rows = [(step, now, seconds)]  # the attempt so far, for the job's figure
        return split

    def summary(self, last_step: int, ended: str) -> tuple[list[str], dict[str, Any]]:
        """The summary's goodput lines and fields, after the end row of goodput.jsonl."""
        split = self.note(last_step, ended)
        lines = [f"goodput {percent(split):.1f} % of {duration(split['wall'])}: " + _categories(split)]
        record: dict[str, Any] = {"goodput_percent": round(percent(split), 3),
                                  "goodput_seconds": {k: round(v, 3) for k, v in split.items()}}
        if self.file is not None and self.earlier:
            job = job_split([*self.earlier, self.current])
            attempts = len(self.earlier) + 1
            lines.append(f"job goodput {percent(job):.1f} % of {duration(job['wall'])} over {attempts} attempts: "
                         f"restarts {duration(job['restarts'])}, redone {duration(job['redone'])}; "
                         + _categories(job))
            record.update(job_goodput_percent=round(percent(job), 3), job_attempts=attempts,
                          job_goodput_seconds={k: round(v, 3) for k, v in job.items()})
        return lines, record

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _categories(split: dict[str, float]) -> str:
    s = {k: duration(v) for k, v in split.items()}
    return (f"productive {s['productive']}, start-up {s['startup']}, compilation and warm-up {s['compilation']}, "
            f"checkpoint save {s['checkpoint_save']} / load {s['checkpoint_load']}, data {s['data_waiting']}, "
            f"validation {s['validation']}")
