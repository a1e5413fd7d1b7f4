import pytest

from tests.machinery.warm_launcher import run_warm
from torchtitan.tools.layout_matrix import MatrixRunner
from torchtitan.tools.parity import ParityHarness


@pytest.fixture(scope="session")
def parity(tmp_path_factory) -> ParityHarness:
    """One harness per test session: the seed checkpoint and the baseline are made once and
    shared by every parity test. Runs fork from the warm launcher (the product runner starts real
    processes, about 3 s of imports each)."""
    return ParityHarness(tmp_path_factory.mktemp("parity"), runner=run_warm)


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> MatrixRunner:
    """The layout matrix's runner, shared by the matrix and memory tests: each point runs once,
    each model's seed checkpoint and baseline once."""
    return MatrixRunner(tmp_path_factory.mktemp("matrix"), runner=run_warm)
