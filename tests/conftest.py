import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _machine_cache_in_tmp(tmp_path_factory):
    """Runs started by the tests keep what they cache per machine (the CPU's measured peak FLOP/s)
    in the session's temporary folder, not in the user's ~/.cache."""
    os.environ.setdefault("TORCHTITAN_CACHE_DIR", str(tmp_path_factory.mktemp("machine_cache")))
    yield
