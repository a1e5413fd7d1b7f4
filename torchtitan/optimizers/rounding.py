"""Storing fp32 values into a bf16 buffer: round to nearest, or stochastically (unbiased).

Optimizer state kept in bf16 (low_precision_adamw.py; Muon's momentum later) is updated in fp32 and
written back through `store_rounded`. Nearest rounding loses an update smaller than half a bf16 ulp
of the value every time (an EMA with beta2 = 0.95 adds 5% of the new value: often below that, so
the moment can stall); stochastic rounding keeps it in expectation.
"""

from __future__ import annotations

import torch

# The low 16 bits of an fp32 are the part bf16 drops; as an int32 mask, the high 16 it keeps.
_LOW_BITS = 1 << 16
_HIGH_MASK = -_LOW_BITS


class RoundingStream:
    """The random bits of `store_rounded`: a generator per device (drawing there reads nothing on the
    host), reseeded from (seed, step) at the first draw of each step, so a run repeats and a resumed
    one continues where it was. Share one among the optimizers of a job (one per parameter when they
    step in backward) so each tensor draws its own bits instead of the same ones."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded_for: dict[torch.device, int] = {}

    def generator(self, device: torch.device, step: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        if self._seeded_for.get(device) != step:  # reseeding is host-side: no device read
            self._generators[device].manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
            self._seeded_for[device] = step
        return self._generators[device]

    def restart(self) -> None:
        """After a checkpoint load: the next draw reseeds, whatever step was drawn for before."""
        self._seeded_for.clear()


def store_rounded(dst: torch.Tensor, src: torch.Tensor, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> None:
    """dst (bf16) <- src (fp32), rounded to nearest even, or stochastically: a uniform random number
    below 2**16 is added to src's bit pattern and the low 16 bits dropped, so src rounds up to the
    next bf16 with probability (its distance from the lower one) / (their gap): unbiased, and each
    result is one of src's two bf16 neighbours. Works on the magnitude bits, so alike for either sign;
    infinities stay; a NaN may become an infinity (a state already lost). Local tensors only (call it
    on DTensor.to_local()); dst and src of one shape."""
    if not stochastic:
        dst.copy_(src)  # to nearest even
        return
    bits = src.detach().contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    # After the mask the value is exactly representable in bf16, so the copy below does not round again.
    dst.copy_(noise.add_(bits).bitwise_and_(_HIGH_MASK).view(torch.float32))
