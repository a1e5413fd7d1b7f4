"""torchrun with one line at the end: `python -m torchtitan.launch [torchrun options] -m torchtitan.train ...`.

run_llama_train.sh starts training through this wrapper. It runs torchrun's own launcher in this
process with a report folder for the ranks (torchtitan.errors), and when the job ends it prints
why, once: the `error:` line of whichever rank found a mistake first, the `stopped:` line of a
Ctrl-C, or the one traceback of a bug, instead of torchrun's multi-screen failure report (which a
rank's one-line error would be buried in, or which, with LOG_RANK=0, is all a user would see of a
mistake found on rank 1). The exit code is the root cause's (README "Exit codes").

It also carries what torchrun leaves to its users: SIGUSR1 (a scheduler's warning before a time
limit) reaches the ranks like SIGTERM does, instead of killing the launcher; a rank that a peer's
watchdog names as hung is killed at once (a stopped or wedged process ignores the SIGTERM that
torchrun sends first, and would hold the job for torchrun's grace period); and after restarts
(MAX_RESTARTS) the ending is the last attempt's, with the number of restarts said.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

from torchtitan.errors import EXIT_USER, REPORT_DIR_ENV, attempts_started, read_reports, summarize

STOP_GRACE_SECONDS = 300  # TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides it


def _quiet_torchrun() -> None:
    """torchrun's agent logs every worker it signals or sees fail; the summary line replaces that.
    LOGLEVEL (torchrun's own variable) set by the user keeps its logs."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _is_my_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def _kill_hung_ranks(folder: str, done: threading.Event) -> None:
    """Kills, with SIGKILL, the ranks of this node that a peer's hang report names as stuck
    (torchtitan/watchdog.py). Only children of this launcher are touched, so a pid reused by
    another process, or a rank of another node, is left alone."""
    killed: set[int] = set()
    while not done.wait(0.5):
        for report in read_reports(folder):
            for entry in report.stuck:
                pid = int(entry.get("pid", 0))
                if pid and pid not in killed and _is_my_child(pid):
                    killed.add(pid)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _rendezvous_failure(args, e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    detail = (str(cause).splitlines() or [""])[0] if cause is not None else ""
    detail = detail or (str(e).splitlines() or [type(e).__name__])[0]
    return (f"the {args.nnodes} nodes did not meet at the rendezvous RDZV_ENDPOINT={args.rdzv_endpoint} "
            f"({type(e).__name__}: {detail[:300]}); check that node 0 (NODE_RANK=0) runs there, that its port is free "
            "and reachable from every node, and that every node has the same NNODES and RDZV_ID")


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # torchrun gives the ranks 30 s to end after passing on a signal, then kills them; a stop waits
    # for the step under way and the checkpoint due at it, which on a large model takes longer.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_SECONDS))
    if "SIGUSR1" not in args.signals_to_handle:
        args.signals_to_handle += ",SIGUSR1"  # passed on to the ranks like SIGTERM, not left to kill the launcher
    # Every rank's full output (LOG_RANK shows only some) goes to a folder that is removed after a
    # run that ended well and kept, and named, after one that did not.
    own_logs = args.log_dir is None
    if own_logs:
        args.log_dir = tempfile.mkdtemp(prefix="torchtitan-logs-")
    with tempfile.TemporaryDirectory(prefix="torchtitan-reports-") as folder:
        os.environ[REPORT_DIR_ENV] = folder  # the ranks inherit the launcher's environment
        _quiet_torchrun()
        exit_codes: dict[int, int] = {}
        signum = 0
        done = threading.Event()
        killer = threading.Thread(target=_kill_hung_ranks, args=(folder, done), daemon=True)
        killer.start()
        try:
            run(args)
        except ChildFailedError as e:
            exit_codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        except SignalException as e:
            signum = int(e.sigval)  # the agent has passed it on and waited for the ranks to stop
        except RendezvousError as e:  # the nodes never met: an endpoint, port or node that is wrong
            if own_logs:
                shutil.rmtree(args.log_dir, ignore_errors=True)
            print(f"error: {_rendezvous_failure(args, e)}", file=sys.stderr, flush=True)
            return EXIT_USER
        finally:
            done.set()
            killer.join()
        reports = read_reports(folder)
        code, text = summarize(reports, exit_codes, signum)
        restarts = attempts_started(folder)
    unexplained = code != 0 and not any(r.kind in ("error", "hang", "stopped", "preempted") for r in reports)
    if restarts:  # the failures that were recovered from are told by the earlier attempts' output
        note = (f"torchrun restarted the ranks {restarts} time{'s' if restarts > 1 else ''} after failures "
                f"(MAX_RESTARTS); every attempt's output: {args.log_dir}")
        text = f"{text}\n({note})" if text else f"note: {note}"
    elif unexplained:  # a bug, or a rank that ended without a word: its output may tell
        text += f"\n(every rank's full output: {args.log_dir})"
    elif own_logs:
        shutil.rmtree(args.log_dir, ignore_errors=True)
    if text:
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
