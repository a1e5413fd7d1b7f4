"""torchrun with one line at the end: `python -m torchtitan.launch [torchrun options] -m torchtitan.train ...`.

run_llama_train.sh starts training through this wrapper. It runs torchrun's own launcher in this
process with a report folder for the ranks (torchtitan.errors), and when the job ends it prints
why, once: the `error:` line of whichever rank found a mistake first, the `stopped:` line of a
Ctrl-C, or the one traceback of a bug, instead of torchrun's multi-screen failure report (which a
rank's one-line error would be buried in, or which, with LOG_RANK=0, is all a user would see of a
mistake found on rank 1). The exit code is the root cause's (README "Exit codes").
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from torchtitan.errors import REPORT_DIR_ENV, read_reports, summarize


def _quiet_torchrun() -> None:
    """torchrun's agent logs every worker it signals or sees fail; the summary line replaces that.
    LOGLEVEL (torchrun's own variable) set by the user keeps its logs."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchtitan-reports-") as folder:
        os.environ[REPORT_DIR_ENV] = folder  # the ranks inherit the launcher's environment
        _quiet_torchrun()
        exit_codes: dict[int, int] = {}
        signum = 0
        try:
            run(args)
        except ChildFailedError as e:
            exit_codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        except SignalException as e:
            signum = int(e.sigval)  # the agent has passed it on and waited for the ranks to stop
        code, text = summarize(read_reports(folder), exit_codes, signum)
    if text:
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
