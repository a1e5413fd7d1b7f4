"""The test suite's light stand-in for `torchrun --standalone` on one machine, on CPU.

    python -m tests.machinery.local_ranks NPROC [trainer options...]     (from the repository root)

Imports the trainer (and so torch) once, then forks NPROC ranks that each run
`torchtitan.train.main` with the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables.
On a small machine most of a short multi-rank test run is every rank importing torch and
torchrun's agent doing the same; forking from a warm parent skips both (a quarter of the test
suite's time). Test machinery only: users launch with run_llama_train.sh (torchrun), and the
launcher's own tests keep covering that path. Like `torchtitan.runtime.launch`, it gives the ranks a report
folder and prints the root cause once; if one rank fails, the others are terminated and its exit
code is returned. CPU only: CUDA cannot be used after fork from a parent that touched it (the
parent never does, but a GPU run should use torchrun anyway).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import traceback

from torchtitan.runtime.reports import REPORT_DIR_ENV, read_reports, summarize


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, nproc: int, port: int, args: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torchtitan import train
    from torchtitan.runtime import process_group

    try:
        code = train.main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank's crash becomes its exit code, as under torchrun
        traceback.print_exc()
        code = 1
    process_group.exit_process(code)


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m tests.machinery.local_ranks NPROC [trainer options...]", file=sys.stderr)
        return 2
    nproc, args = int(argv[0]), argv[1:]
    import torchtitan.train  # noqa: F401 - the warm import every rank inherits

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="torchtitan-reports-") as folder:
        # As under run_llama_train.sh: ranks report how they ended, and one line says why.
        os.environ[REPORT_DIR_ENV] = folder
        sys.stdout.flush()
        sys.stderr.flush()
        children: dict[int, int] = {}
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _run_rank(rank, nproc, port, args)  # never returns
            children[pid] = rank
        exit_codes: dict[int, int] = {}
        while children:
            pid, status = os.wait()
            rank = children.pop(pid, None)
            rank_code = os.waitstatus_to_exitcode(status)
            if rank_code != 0 and not exit_codes:
                for other in children:  # a failed rank leaves its peers waiting on collectives
                    try:
                        os.kill(other, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            if rank_code != 0 and rank is not None:
                exit_codes[rank] = rank_code
        code, text = summarize(read_reports(folder), exit_codes)
    if text:
        print(text, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
