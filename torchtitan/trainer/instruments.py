"""What watches a training step from outside: the watchdog's phase marks, the timers behind the step
line (LogWindow), the goodput ledger's (observability/goodput.py), and the profiler's and the memory
snapshot's step. The Trainer calls these at the boundaries of its phases, in one place
(Trainer.train_step), so that the methods holding a step's numerics carry none of them."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from torchtitan.observability.goodput import Goodput
from torchtitan.observability.metrics import LogWindow
from torchtitan.observability.profiling import MemorySnapshot
from torchtitan.observability.watchdog import Watchdog, collective_timeout
from torchtitan.runtime import process_group

# Phases whose time the goodput ledger counts apart from the steps' own, by its category.
_GOODPUT_CATEGORIES = {"checkpoint save": "checkpoint_save"}


class StepInstruments:
    """One training run's instruments, from its first step (`first_step`) on. `profiler` and
    `memory_snapshot` are the profiling contexts' objects (None when that profiling is off); `goodput`
    the run's ledger, whose start-up ends as the instruments are made, just before the first step."""

    def __init__(self, watchdog: Watchdog, first_step: int, profiler: Any = None,
                 memory_snapshot: MemorySnapshot | None = None, goodput: Goodput | None = None):
        self.watchdog = watchdog
        self.window = LogWindow(first_step)  # what the steps since the last step line did
        self.profiler, self.memory_snapshot = profiler, memory_snapshot
        self.goodput = goodput if goodput is not None else Goodput()
        self.goodput.loop_started()

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Marks where this rank is until the next phase (the watchdog names a rank that stays in
        one too long). Entering the phase a rank is already in keeps its start: the limit counts
        from the first entry."""
        if (name, self.watchdog.step if step is None else step) != (self.watchdog.phase, self.watchdog.step):
            self.watchdog.enter(name, step)
        with self.goodput.counting(_GOODPUT_CATEGORIES.get(name)):
            yield

    @contextlib.contextmanager
    def own_time(self, loading_data: bool = False) -> Iterator[None]:
        """Times this rank's own work, where ranks do not wait for each other (loading data, the
        optimizer step): the step line compares the slowest rank's with the median."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.window.own_seconds += seconds
        if loading_data:
            self.window.data_seconds += seconds
            self.goodput.add("data_waiting", seconds)

    def count_tokens(self, micro_batches: list) -> None:
        # The whole sequences, before context parallelism cuts them.
        self.window.tokens += sum(batch[1].numel() for batch in micro_batches)

    def window_seconds(self) -> float:
        """Wall time since the step line's window began (validation left out)."""
        return time.perf_counter() - self.window.start

    def leave_out(self, seconds: float) -> None:
        """Keeps time spent beside training (validation) out of the window's throughput."""
        self.window.start += seconds

    def step_done(self) -> None:
        self.goodput.step_done()
        if self.profiler is not None:
            self.profiler.step()
        if self.memory_snapshot is not None:
            self.memory_snapshot.step()

    def first_step_done(self, train_timeout_seconds: float) -> None:
        """After the run's first step (a resumed run's too: its first step is the slow one) the
        watchdog and the process group wait as long as a step may take, no longer start-up's limit."""
        self.watchdog.set_limit(train_timeout_seconds)
        process_group.set_timeout(collective_timeout(train_timeout_seconds))
