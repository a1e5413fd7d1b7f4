"""Logger set-up: one format for every module, `[titan]` prefixed, to stdout."""

import logging
import sys

logger = logging.getLogger("torchtitan")


def init_logger(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[titan] %(asctime)s - %(levelname)s - %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
