"""Stop signals: SIGINT, SIGTERM and SIGUSR1 as requests to stop every rank after the same step."""

from __future__ import annotations

import os
import signal
import sys
import time

from torchtitan.runtime.reports import reporting_to_folder, write_report

# The signals that ask for a checkpoint before stopping: what schedulers send before ending a job
# (SLURM: SIGTERM at preemption and cancellation, SIGUSR1 ahead of the time limit with --signal).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """SIGINT, SIGTERM and SIGUSR1 as requests to stop at the next step boundary.

    The first signal is only noted: the training loop agrees on it across ranks once per step and
    then every rank stops after the same step (SIGTERM and SIGUSR1 with a checkpoint of that step,
    PREEMPTION_SIGNALS). A second signal, from 2 s after the first on, ends this process at once (exit
    128 + signal), for a step that will not finish; the launcher then stops the other ranks.
    Installed only once training starts: during start-up SIGTERM ends a rank at once (a rank
    waiting for a peer that already failed must not wait out a timeout) and Ctrl-C interrupts.
    """

    SIGNALS = (signal.SIGINT, *PREEMPTION_SIGNALS)
    # A repeat within this many seconds is the first request delivered twice, not an insistence:
    # SLURM signals every process of a job step, ranks included, and the launcher passes the same
    # signal on to them a moment later.
    REPEAT_WINDOW_SECONDS = 2.0

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.requested = 0  # the first signal received, 0 if none
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        if self._previous:
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame) -> None:
        if self.requested and time.monotonic() - self._first_at < self.REPEAT_WINDOW_SECONDS:
            return
        if self.requested:
            line = (f"stopped: {signal.Signals(signum).name} received again; ended at once, during a step "
                    "(the newest checkpoint stays)")
            if reporting_to_folder():
                write_report(self.rank, 128 + signum, line, "stopped")
            else:
                print(line, file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested, self._first_at = signum, time.monotonic()
