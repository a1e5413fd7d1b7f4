"""Session-wide test settings: the machine cache in a temporary folder, the test tiers, and the
report of where the suite's time went (docs/testing.md).

Tiers: every test of `unit_tests/` is in the `fast` tier; an integration test joins it with
`@pytest.mark.fast` (the cheapest multi-process test of each feature). `./scripts/test.sh --fast`
runs that tier alone; `./scripts/test.sh` runs every test.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

UNIT_TESTS = Path(__file__).resolve().parent / "unit_tests"
# A test over this many seconds (setup, call and teardown) needs a reason: `@pytest.mark.budget("why")`.
TEST_BUDGET_SECONDS = 20.0
SLOWEST_SHOWN = 25


@pytest.fixture(scope="session", autouse=True)
def _machine_cache_in_tmp(tmp_path_factory):
    """Runs started by the tests keep what they cache per machine (the CPU's measured peak FLOP/s)
    in the session's temporary folder, not in the user's ~/.cache."""
    os.environ.setdefault("TORCHTITAN_CACHE_DIR", str(tmp_path_factory.mktemp("machine_cache")))
    yield


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteClock(), "suite_clock")


@pytest.hookimpl(tryfirst=True)  # before `-m fast` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if UNIT_TESTS in item.path.parents:
            item.add_marker(pytest.mark.fast)


class SuiteClock:
    """Adds up each test's time (setup, call and teardown) and reports it by tier at the end."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.durations: dict[str, float] = {}
        self.fast: set[str] = set()
        self.reasons: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.fast = {item.nodeid for item in items if item.get_closest_marker("fast")}
        self.reasons = {item.nodeid: mark.args[0] for item in items if (mark := item.get_closest_marker("budget"))}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """The time per tier, the slowest tests, and the tests over the budget without a reason."""
        if not self.durations:
            return
        write = terminalreporter.write_line
        terminalreporter.section("where the time went")
        for tier, in_tier in (("fast", True), ("rest", False)):
            times = [d for n, d in self.durations.items() if (n in self.fast) == in_tier]
            write(f"tier {tier}: {len(times)} tests, {sum(times):.1f} s of test time")
        write(f"session: {len(self.durations)} tests in {time.monotonic() - self.start:.1f} s of wall time "
              "(collection included)")
        write(f"slowest {SLOWEST_SHOWN}:")
        for nodeid, seconds in sorted(self.durations.items(), key=lambda kv: -kv[1])[:SLOWEST_SHOWN]:
            write(f"  {seconds:6.1f} s  {nodeid}{'  [fast]' if nodeid in self.fast else ''}")
        if path := os.environ.get("TORCHTITAN_TEST_TIMES"):
            # Every test's seconds, to choose what to make cheaper (docs/testing.md).
            Path(path).write_text(json.dumps(self.durations, indent=0, sort_keys=True))
        for nodeid, seconds in self.durations.items():
            if seconds > TEST_BUDGET_SECONDS and nodeid not in self.reasons:
                write(f"over the {TEST_BUDGET_SECONDS:.0f} s budget without a reason (@pytest.mark.budget): "
                      f"{nodeid} ({seconds:.1f} s)")


@pytest.fixture(autouse=True)
def _unmeasured_processes(request, monkeypatch):
    """A test marked `unmeasured` starts its processes without coverage: coverage starts in a new
    Python process only when this variable says how (`patch = subprocess`), and the warm launcher's
    jobs stop it when their environment lacks it. Such a test's error paths must run elsewhere."""
    if request.node.get_closest_marker("unmeasured") is not None:
        monkeypatch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)


@pytest.fixture(autouse=True)
def _process_state_given_back():
    """Many tests call a script's or the trainer's `main()` in this process, which sets up the
    process as its own (the torchtitan logger's handlers, and no propagation, which would hide its
    records from later tests' caplog; gc.freeze of the imports): every test gets the state back."""
    import gc
    import logging

    logger = logging.getLogger("torchtitan")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    gc.unfreeze()
