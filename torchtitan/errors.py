"""The error types a run ends with, and their exit codes.

Exit codes (README "Exit codes"):

    0    finished
    1    a bug: one traceback
    2    a mistake the user can fix (config, launcher variables, data, tokenizer, the checkpoint to
         load, sizes that cannot fit, running out of memory): one `error:` line
    3    training diverged: a non-finite loss or gradient norm (one `error:` line)
    4    a checkpoint could not be saved (disk full, I/O error): one `error:` line
    5    a rank stopped making progress (a hang): one `error:` line naming the stuck rank(s)
    75   preempted: SIGTERM or SIGUSR1 stopped every rank after the same step, with a checkpoint
         saved at it; relaunching resumes from it (75 is sysexits' EX_TEMPFAIL, "try again")
    130  stopped by SIGINT (Ctrl-C) at a step boundary: one `stopped:` line
    138  stopped by SIGUSR1, 143 by SIGTERM, without a checkpoint (during start-up, a second
         signal, or checkpointing off): one `stopped:` line

How a rank says how it ended (one line, or a report to the launcher) is runtime/reports.py;
the stop signals are runtime/signals.py. Nothing here imports torch.
"""

from __future__ import annotations

import signal

EXIT_BUG = 1
EXIT_USER = 2
EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 4
EXIT_HANG = 5
EXIT_PREEMPTED = 75


class RunEnded(Exception):
    """A run that ends for a reason one line explains; `exit_code` is what the process returns."""

    exit_code = EXIT_BUG
    prefix = "error"

    @property
    def line(self) -> str:
        # One line whatever the message quotes: a path or a value may hold a line break.
        return f"{self.prefix}: {self}".replace("\r", "\\r").replace("\n", "\\n")

    def add_context(self, note: str) -> None:
        """Appends what the caller knows and the raiser did not (e.g. the newest checkpoint)."""
        self.args = (f"{self.args[0]}; {note}" if self.args else note, *self.args[1:])


class UserError(RunEnded):
    """A mistake the user can fix; the message is one line naming the option or file."""

    exit_code = EXIT_USER


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; its message is one line naming the option.

    Defined here, in a module that imports nothing from the features, so that every feature can
    raise it without importing the config parser (and the parser can collect the features' rules)."""


class DatasetError(UserError, ValueError):
    """A dataset name, file or line the user can fix; the message names it."""


class CheckpointError(UserError, ValueError):
    """A checkpoint the run cannot use (missing, incomplete, damaged, or from another model);
    the message is one line naming the folder and, where there is one, the option to change.

    Defined here rather than in the checkpoint package, whose manager imports the model registry,
    so that a model family's Hugging Face adapter can raise it without an import circle."""


class OutOfMemory(UserError):
    """An allocation failed although the start-up size check let the job through."""


class TrainingDiverged(RunEnded):
    """The loss or gradient norm stopped being finite; the optimizer step was not taken."""

    exit_code = EXIT_DIVERGED


class Hang(RunEnded):
    """A rank stopped making progress; the message names it and what the others waited in."""

    exit_code = EXIT_HANG


class Stopped(RunEnded):
    """SIGINT, SIGTERM or SIGUSR1 asked the run to stop; every rank stopped after the same step."""

    prefix = "stopped"

    def __init__(self, signum: int, step: int | None, checkpoint: str = ""):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__()

    @property
    def exit_code(self) -> int:  # the shell's convention for "ended by signal N"
        return 128 + self.signum

    def add_context(self, note: str) -> None:
        self.checkpoint = note

    def __reduce__(self):
        # Exceptions cross processes pickled (DCP's gathered failures, a background save's
        # process); Exception's pickling would call this constructor with no arguments.
        return type(self), (self.signum, self.step, self.checkpoint)

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        newest = f"; {self.checkpoint}" if self.checkpoint else ""
        when = "during start-up, before the first step" if self.step is None else f"after step {self.step}"
        return f"{name} received; stopped {when}{newest}"


class Preempted(Stopped):
    """SIGTERM or SIGUSR1 (a scheduler's preemption or time limit) stopped every rank after the same
    step and a checkpoint of that step was saved: the job can be launched again to resume."""

    exit_code = EXIT_PREEMPTED

    def __str__(self) -> str:
        saved = self.checkpoint.removeprefix("newest checkpoint: ")
        return (f"{signal.Signals(self.signum).name} received; stopped after step {self.step} and saved its checkpoint: "
                f"{saved}; launch the job again to resume from it")




_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


_TRAINING_FIX = ("lower training.batch_size or training.seq_len, or spread the model over more ranks "
                 "(data_parallel_shard_degree, tensor/pipeline parallel)")


def out_of_memory(exc: BaseException, fix: str = _TRAINING_FIX) -> OutOfMemory | None:
    """The exception as one line, ending with `fix`, if it is a failed allocation (CUDA, CPU or
    Python), else None."""
    name = type(exc).__name__
    text = str(exc)
    if name == "OutOfMemoryError" or isinstance(exc, MemoryError) or any(m in text for m in _CPU_OOM):
        detail = next((ln.strip() for ln in text.splitlines() if "allocate" in ln), text.splitlines()[0] if text else name)
        if "DefaultCPUAllocator" in detail:
            detail = detail[detail.index("DefaultCPUAllocator") + len("DefaultCPUAllocator: "):]
        return OutOfMemory(f"out of memory: {detail.rstrip('.')}; {fix}")
    return None
