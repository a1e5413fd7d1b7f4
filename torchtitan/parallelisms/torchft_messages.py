"""What torchft reports, turned into what this project prints (parallelisms/fault_tolerance.py): its
manager's tracebacks of a failed collective or recovery become the reason on the one warning that
a step was not committed, and a quorum that failed is told apart from a lighthouse that is gone."""

from __future__ import annotations

import logging
import re
import socket


class TorchftLog(logging.Filter):
    """torchft's manager log, quieted: its per-reconfiguration note that NCCL's flight recorder cannot
    be reset (true of every run without NCCL) is dropped, and so is its traceback of a failed
    collective or recovery, whose first line is kept for the warning that the step was not committed."""

    def __init__(self):
        super().__init__()
        self._failure: str | None = None

    @classmethod
    def install(cls) -> TorchftLog:
        """A new filter on torchft's manager log, replacing an earlier one (of a manager closed before)."""
        log, new = logging.getLogger("torchft.manager"), cls()
        for old in [f for f in log.filters if isinstance(f, cls)]:
            log.removeFilter(old)
        log.addFilter(new)
        return new

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.levelno >= logging.ERROR:
            error = record.exc_info[1] if record.exc_info else None
            self.failed(str(error) if error is not None else record.getMessage().split("] ", 1)[-1])
            return False
        return "flight recorder" not in record.getMessage()

    def failed(self, message: str) -> None:
        """Keeps the first failure of a step: gloo's "[file:line] What happened. Advice..." as "What happened"."""
        if self._failure is None:
            first = message.strip().splitlines()[0] if message.strip() else "no message"
            first = re.sub(r"^[^\]]*\[[^\]]*\.(cc|cpp|h|py):\d+\] ", "", first)  # gloo's source location
            self._failure = first.split(". ")[0][:200]

    def take(self) -> str | None:
        failure, self._failure = self._failure, None
        return failure


def lighthouse_answers(address: str, seconds: float = 3.0) -> bool:
    """Whether anything accepts a connection at host:port (the lighthouse)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except (OSError, ValueError):
        return False
    return True
