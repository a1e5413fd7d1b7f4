"""Where a run stands (step x of N, elapsed, estimated time left) and what it did (the final summary).

The estimate leaves out the run's first step, which pays for start-up work later steps do not
(compilation, allocator warm-up, the first collectives), and counts validation separately: the
validation runs still to come cost what the last one did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def duration(seconds: float) -> str:
    """1:02:03, 2:03 or 3.4s: short enough for every console line."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Progress:
    total_steps: int
    first_step: int  # this run's first step: 1, or the step after a resumed checkpoint's
    validation_freq: int = 0  # 0: no validation
    start: float = field(default_factory=time.perf_counter)
    _steady_since: float | None = None  # end of this run's first step
    _side_seconds: float = 0.0  # validation since then, kept out of the per-step time
    _last_validation: float = 0.0

    def step_done(self, step: int) -> None:
        if self._steady_since is None:
            # The first step this run finished: first_step, or a later one when a fault-tolerant
            # replica group recovered from a peer and took its step count.
            self.first_step = step
            self._steady_since = time.perf_counter()

    def validation_done(self, seconds: float) -> None:
        self._last_validation = seconds
        if self._steady_since is not None:
            self._side_seconds += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self, step: int) -> float | None:
        """Seconds left after `step`; None until a step after the first has been timed."""
        if self._steady_since is None or step <= self.first_step:
            return None
        per_step = max(0.0, time.perf_counter() - self._steady_since - self._side_seconds) / (step - self.first_step)
        left = (self.total_steps - step) * per_step
        if self.validation_freq:
            # Runs at every multiple of freq after `step`, and at the last step if that is none.
            runs = self.total_steps // self.validation_freq - step // self.validation_freq
            runs += self.total_steps % self.validation_freq != 0 and step < self.total_steps
            left += runs * self._last_validation
        return left

    def text(self, step: int) -> str:
        """`elapsed 1:02  eta 3:04` for the console's step line."""
        left = self.remaining(step)
        return f"elapsed {duration(self.elapsed())}  eta {duration(left) if left is not None else '?'}"


def summary(progress: Progress, last_step: int, tokens: int, tokens_per_second: float, mfu: float,
            validations: dict[int, float], outputs: dict[str, str], ended: str = "done",
            steady: tuple[float, float] | None = None) -> tuple[list[str], dict]:
    """The run's closing lines and its {"record": "summary", ...} row: steps, tokens, wall time,
    mean throughput and MFU per device over the whole run and, `steady`, over the steps after the
    first step line (whose compilation and warm-up the whole-run mean includes), final and best
    validation loss, where the outputs went."""
    steps = last_step - progress.first_step + 1
    wall = progress.elapsed()
    span = f"steps {progress.first_step}-{last_step}" if steps > 1 else f"step {last_step}"
    rate = f"mean {tokens_per_second:,.0f} tokens/s per device, MFU {mfu:.2f}%"
    if steady is not None:
        rate = (f"steady state {steady[0]:,.0f} tokens/s per device, MFU {steady[1]:.2f}% (after the first step "
                f"line); whole run {tokens_per_second:,.0f} tokens/s, MFU {mfu:.2f}%")
    lines = [f"run summary ({ended}): {steps} steps ({span} of {progress.total_steps}), {tokens:,} tokens in "
             f"{duration(wall)}; {rate}"]
    record = {"record": "summary", "ended": ended, "first_step": progress.first_step, "last_step": last_step,
              "steps": steps, "tokens": tokens, "wall_seconds": wall, "tokens_per_second_per_device": tokens_per_second,
              "mfu_percent": mfu}
    if steady is not None:
        record.update(steady_tokens_per_second_per_device=steady[0], steady_mfu_percent=steady[1])
    if validations:
        final_step = max(validations)
        best_step = min(validations, key=validations.get)
        lines.append(f"validation loss: final {validations[final_step]:.4f} (step {final_step}), best "
                     f"{validations[best_step]:.4f} (step {best_step})")
        record.update(final_validation_loss=validations[final_step], final_validation_step=final_step,
                      best_validation_loss=validations[best_step], best_validation_step=best_step)
    if outputs:
        lines.append("outputs: " + "; ".join(f"{what} {where}" for what, where in outputs.items()))
        record["outputs"] = outputs
    return lines, record
