"""bf16 compute against fp32 over 30 steps, one process (autocast: no FSDP to cast). The bf16
layouts against one bf16 process are the parity harness's bf16 suite (test_parity.py)."""

from tests.helpers import TINY_RUN, losses, run_train
from torchtitan.tools.parity_layouts import BF16
from torchtitan.tools.runs import read_setup

STEPS = 30
# Measured: at most 4.7e-4 apart over the 30 steps (the loss falls 0.24 meanwhile); bf16 keeps 8
# bits of mantissa in each matmul's output, so the band is ten times that, not fp32's 1e-6. Every CPU
# kernel rounds a bf16 matmul's fp32 sum once: 4.3e-4 with PyTorch's own, as on a CPU without
# AVX-512 (ATEN_CPU_CAPABILITY=avx2, oneDNN off).
BAND = 5e-3


def test_bf16_tracks_fp32_over_30_steps(tmp_path):
    runs = {}
    for dtype in ("float32", "bfloat16"):
        folder = tmp_path / dtype
        run_train([*TINY_RUN, *BF16.split(), "--training.seq_len", "32", "--training.steps", str(STEPS),
                   "--training.mixed_precision_param", dtype, "--job.dump_folder", str(folder)])
        runs[dtype] = (losses(folder), read_setup(folder)["autocast"])
    (fp32, fp32_autocast), (bf16, bf16_autocast) = runs["float32"], runs["bfloat16"]
    assert fp32_autocast is None and bf16_autocast == {"dtype": "bfloat16", "parts": 1}
    diffs = [abs(a - b) for a, b in zip(fp32, bf16)]
    print(f"bf16 vs fp32 over {STEPS} steps: max |loss diff| {max(diffs):.2e}, fp32 {fp32[0]:.4f} -> {fp32[-1]:.4f}")
    assert len(diffs) == STEPS and max(diffs) <= BAND, diffs
    assert max(diffs) > 1e-6, "bf16 gave fp32's losses exactly: the run did not compute in bf16"
    assert bf16[-1] < bf16[0] - 0.1  # and it learns
