import pytest

from tests.helpers import TINY_RUN, losses
from tests.machinery.layout_matrix import MatrixRunner
from tests.machinery.warm_launcher import run_warm
from torchtitan.tools.parity import ParityHarness


@pytest.fixture(scope="session")
def parity(tmp_path_factory) -> ParityHarness:
    """One harness per test session: the seed checkpoint and the baseline are made once and
    shared by every parity test. Runs fork from the warm launcher (the product runner starts real
    processes, about 3 s of imports each)."""
    return ParityHarness(tmp_path_factory.mktemp("parity"), steps=PARITY_CI_STEPS, runner=run_warm, base_args=TINY_RUN)


@pytest.fixture(scope="session")
def parity_10_steps(tmp_path_factory) -> ParityHarness:
    """A harness of 10 steps, loss_compare.py's count, for the suites whose issue asks CI for that
    many (gpt-oss: its rows cost about 1 s more each than at 6 steps; the baseline is their own anyway)."""
    return ParityHarness(tmp_path_factory.mktemp("parity10"), steps=10, runner=run_warm, base_args=TINY_RUN)


# The CI part of the matrix trains 4 steps per point and the parity suites 6 (scripts/loss_compare.py:
# 10): past the warm-up, with Adam's moments carried, at a fraction of the time. Both validate after
# step 3 and at their last step (parity.COMPARISON_ARGS): the matrix's step 4 follows a validation
# run, and every baseline's held-out loss falls from step 3 to 4 (by 0.008-0.03 on the tiny models).
MATRIX_CI_STEPS = 4
PARITY_CI_STEPS = 6


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> MatrixRunner:
    """The layout matrix's runner, shared by the matrix and memory tests: each point runs once,
    each model's seed checkpoint and baseline once."""
    return MatrixRunner(tmp_path_factory.mktemp("matrix"), steps=MATRIX_CI_STEPS, runner=run_warm)


UNINTERRUPTED_STEPS = 8


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> list[float]:
    """Per-step losses of the tiny 2-rank FSDP job of 8 steps (a checkpoint every 2), never
    interrupted: what the preemption and restart tests must reproduce bit for bit (saving a
    checkpoint does not change what a job computes, so their own intervals may differ)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run_warm([*TINY_RUN, "--training.steps", str(UNINTERRUPTED_STEPS), "--metrics.log_freq", "1",
              "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--job.dump_folder", str(folder)], nproc=2)
    return losses(folder)
