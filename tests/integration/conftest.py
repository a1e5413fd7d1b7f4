import pytest

from torchtitan.tools.parity import ParityHarness


@pytest.fixture(scope="session")
def parity(tmp_path_factory) -> ParityHarness:
    """One harness per test session: the seed checkpoint and the baseline are made once and
    shared by every parity and memory test."""
    return ParityHarness(tmp_path_factory.mktemp("parity"))
