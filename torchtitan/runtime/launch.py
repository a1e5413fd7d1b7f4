"""torchrun with one line at the end: `python -m torchtitan.runtime.launch [torchrun options] -m torchtitan.train ...`.

run_llama_train.sh starts training through this wrapper. It runs torchrun's own launcher in this
process with a report folder for the ranks (torchtitan.runtime.reports), and when the job ends it prints
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

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta

from torchtitan.errors import EXIT_USER
from torchtitan.observability.goodput import LAUNCH_TIME_ENV
from torchtitan.runtime.reports import REPORT_DIR_ENV, attempts_started, read_reports, summarize

STOP_GRACE_SECONDS = 300  # TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides it
PROGRESS_INTERVAL_SECONDS = 30  # RDZV_PROGRESS_INTERVAL overrides it
# Each node's launcher beats in node 0's store this often while the job runs; a node whose beat has
# not moved over LOST_AFTER_BEATS beats is gone (named when the job ends for want of it).
HEARTBEAT_SECONDS = 1.0
LOST_AFTER_BEATS = 3
# torchrun's default join_timeout (--rdzv-conf), the wait for all nodes; run_llama_train.sh passes RDZV_TIMEOUT.
JOIN_TIMEOUT_SECONDS = 600


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


def _started_ranks() -> bool:
    """Whether this launcher has child processes: torchrun starts the ranks once the rendezvous is done."""
    return any(_is_my_child(int(name)) for name in os.listdir("/proc") if name.isdigit())


def _kill_hung_ranks(folder: str, done: threading.Event) -> None:
    """Kills, with SIGKILL, the ranks of this node that a peer's hang report names as stuck
    (torchtitan/observability/watchdog.py). Only children of this launcher are touched, so a pid reused by
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


def _rdzv_option(args, key: str, default: int) -> int:
    """An integer option of torchrun's --rdzv-conf (`key1=value1,key2=value2`)."""
    for item in args.rdzv_conf.split(","):
        name, _, value = item.partition("=")
        if name.strip() == key and value.strip().isdigit():
            return int(value)
    return default


def _list_ranks(ranks: list[int], shown: int = 8) -> str:
    listed = ", ".join(map(str, ranks[:shown]))
    return listed + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


def _listening_here(port: int) -> bool:
    """Whether this process listens on TCP `port`: on node 0, that torchrun has opened the store
    there (the port may instead be another program's, which a store client must not talk to)."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        # local address (hex ip:port), state 0A = LISTEN, inode
        if any(int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A" and f"socket:[{r[9]}]" in sockets
               for r in rows):
            return True
    return False


class RendezvousWatch:
    """Tells, while this node waits at the rendezvous, how long it has waited and which nodes have
    not arrived: one line on stderr every RDZV_PROGRESS_INTERVAL seconds, none once all are there.

    torchrun's c10d rendezvous keeps who has joined only in a pickled private object in its store.
    So each launcher announces itself in that store on its own, through TCPStore's public API: it
    appends "NODE_RANK host" to one key, and a waiting node reads that key for a line. NNODES
    announcements are the moment torchrun completes the rendezvous too (every node that joins it
    runs this launcher), and the watch also ends once this launcher has started its ranks.

    The store is node 0's. This node's own client connects only once the store is open: a TCPStore
    client that cannot connect logs a screen of C++ errors per try, and node 0's port may be held
    by another program (torchrun's error says so). Until then the line says the store is not open.

    Once the nodes have met, the watch beats for this node in the same store for as long as the job
    runs (a counter under its NODE_RANK, so no clocks are compared). A node lost later (its machine
    gone, launcher and ranks with it) stops beating: when the job then ends for want of it (the
    surviving nodes wait at the next rendezvous for RDZV_TIMEOUT, or fail without restarts), the
    ending names it (`lost()`)."""

    def __init__(self, args: argparse.Namespace, node_rank: int, interval: float) -> None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        self._address = (host, int(port))
        self._endpoint = args.rdzv_endpoint
        self._key = f"torchtitan/rendezvous/{args.rdzv_id}/arrivals"
        self._beats = f"torchtitan/rendezvous/{args.rdzv_id}/alive/"
        self._node_rank = node_rank
        self._my_beat = f"{self._beats}{node_rank}"
        # The address the other nodes know this node by, where it is set (simulated hosts share a name).
        self._host = os.environ.get("LOCAL_ADDR") or socket.gethostname()
        self._me = f"{node_rank} {socket.gethostname()}\n"
        self._hosts_store = node_rank == 0
        self.nnodes = int(args.nnodes)
        self.interval = interval
        self.join_timeout = _rdzv_option(args, "join_timeout", JOIN_TIMEOUT_SECONDS)
        self.arrivals: list[tuple[int, str]] | None = None  # (NODE_RANK, host) as last read; None: not read
        self.met = False  # every node has arrived once (the job's first rendezvous is done)
        self._others: dict[int, tuple[str, str, float]] = {}  # NODE_RANK: (beat, host, when it last moved)
        self._polled_since: float | None = None
        self._start = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()  # no line after stop(): the launcher's own last line comes last
        self._thread = threading.Thread(target=self._watch, name="rendezvous-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Silences the watch, and waits for a store call under way (2 s at most): a thread left in
        one when the interpreter exits can abort it."""
        with self._lock:
            self._done.set()
        self._thread.join(timeout=5)

    def missing(self) -> list[int]:
        arrived = {rank for rank, _ in self.arrivals or ()}
        return [rank for rank in range(self.nnodes) if rank not in arrived]

    def _store_is_open(self) -> bool:
        if self._hosts_store and os.path.exists("/proc/self/net/tcp"):
            return _listening_here(self._address[1])
        try:
            with socket.create_connection(self._address, timeout=1):
                return True
        except OSError:
            return False

    def _watch(self) -> None:
        from torch.distributed import TCPStore

        next_line = self._start + self.interval
        while not self._store_is_open():
            if time.monotonic() >= next_line:
                self._say(int(time.monotonic() - self._start))
                next_line += self.interval
            if self._done.wait(0.5):
                return
        try:
            store = TCPStore(*self._address, is_master=False, timeout=timedelta(seconds=2))
            store.append(self._key, self._me)
            self._read(store)
        except Exception:  # not a store after all: torchrun's own error says what is there
            return
        beat = 0
        while not self._done.wait(max(0.0, min(next_line, time.monotonic() + HEARTBEAT_SECONDS) - time.monotonic())):
            try:
                beat += 1
                store.set(self._my_beat, f"{beat} {self._host}")
                if self.met:
                    # Only while this node has no ranks (a restart's rendezvous, or the job ending)
                    # are the other nodes' beats read: the one time a lost node matters, and a read
                    # of every node's key per beat would load node 0's store on a large job.
                    if not _started_ranks():
                        self._poll_others(store)
                    else:
                        with self._lock:
                            self._polled_since = None
                    continue
                self._read(store)
            except Exception:  # node 0 has gone: torchrun's own error ends the wait
                return
            # Everyone is there; the ranks' start covers a node that joined without announcing itself.
            if len(self.arrivals or ()) >= self.nnodes or _started_ranks():
                self.met = True
                continue
            if time.monotonic() >= next_line:
                self._say(int(time.monotonic() - self._start))
                next_line += self.interval
        try:  # a node that ends on its own is not a lost one
            store.set(self._my_beat, f"left {self._host}")
        except Exception:  # node 0 has gone first
            pass

    def lost(self) -> list[tuple[int, str]]:
        """(NODE_RANK, host) of the other nodes that stopped beating without leaving: unchanged over
        LOST_AFTER_BEATS beats of this node's reads while it has no ranks running (a restart's
        rendezvous, or the end). Waits up to that long for the reads; [] before the nodes first met."""
        if not self.met:
            return []
        span = LOST_AFTER_BEATS * HEARTBEAT_SECONDS
        deadline = time.monotonic() + span + 2 * HEARTBEAT_SECONDS
        while time.monotonic() < deadline and not self._done.is_set():
            with self._lock:
                since = self._polled_since
            if since is not None and time.monotonic() - since >= span:
                break
            time.sleep(HEARTBEAT_SECONDS / 4)
        now = time.monotonic()
        with self._lock:
            seen = dict(self._others)
        return [(rank, host) for rank, (beat, host, moved) in sorted(seen.items())
                if rank != self._node_rank and beat != "left" and now - moved >= span]

    def _poll_others(self, store) -> None:
        """Reads every node's beat; a node's beat that changed is marked as moving now."""
        keys = [f"{self._beats}{rank}" for rank in range(self.nnodes)]
        values = store.multi_get(keys) if all(store.check([k]) for k in keys) else [
            store.get(k) if store.check([k]) else b"" for k in keys]
        now = time.monotonic()
        with self._lock:
            if self._polled_since is None:
                self._polled_since = now
            for rank, value in enumerate(values):
                beat, _, host = value.decode().partition(" ")
                if rank not in self._others or self._others[rank][0] != beat:
                    self._others[rank] = (beat, host or "?", now)

    def _read(self, store) -> None:
        lines = store.get(self._key).decode().splitlines()
        self.arrivals = [(int(rank), host) for rank, _, host in (ln.partition(" ") for ln in lines)]

    def _say(self, waited: int) -> None:
        if self.arrivals is None:
            line = (f"waiting: the rendezvous RDZV_ENDPOINT={self._endpoint} is not open after {waited} s; "
                    "node 0 (NODE_RANK=0) opens it when it starts")
        else:
            line = (f"waiting: {len(self.arrivals)} of {self.nnodes} nodes at the rendezvous "
                    f"RDZV_ENDPOINT={self._endpoint} after {waited} s, missing NODE_RANK {_list_ranks(self.missing())}; "
                    f"the wait ends after RDZV_TIMEOUT={self.join_timeout} s")
            hosts: dict[int, list[str]] = {}
            for rank, host in self.arrivals:
                hosts.setdefault(rank, []).append(host)
            twice = {rank: names for rank, names in hosts.items() if len(names) > 1}
            if twice:
                rank, names = min(twice.items())
                line += f"; NODE_RANK {rank} came from {len(names)} launchers ({', '.join(names)}): give each node its own"
        with self._lock:
            if not self._done.is_set():
                print(line, file=sys.stderr, flush=True)


def _rendezvous_failure(args: argparse.Namespace, e: BaseException, watch: RendezvousWatch | None) -> str:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    where = f"the {args.nnodes} nodes did not meet at the rendezvous RDZV_ENDPOINT={args.rdzv_endpoint}"
    lost = watch.lost() if watch is not None else []
    if lost:  # the nodes had met: one was lost during the job, and the restart's rendezvous waited for it
        seconds = _rdzv_option(args, "join_timeout", JOIN_TIMEOUT_SECONDS)
        return (f"{_lost_nodes(lost)} left the job and did not come back within RDZV_TIMEOUT={seconds} s, which the "
                f"other nodes waited at the rendezvous after restarting; replace the node (same NNODES, RDZV_ENDPOINT and "
                "RDZV_ID) and launch it, or launch the job again on the nodes left: it resumes from the newest checkpoint")
    if isinstance(e, RendezvousTimeoutError):
        seconds = _rdzv_option(args, "join_timeout", JOIN_TIMEOUT_SECONDS)
        missing = watch.missing() if watch is not None and watch.arrivals is not None else []
        who = (f"{len(watch.arrivals)} of {watch.nnodes} arrived, missing NODE_RANK {_list_ranks(missing)}"
               if missing else "not every node arrived")
        return (f"{where} within RDZV_TIMEOUT={seconds} s ({who}); start the missing nodes with the same NNODES, "
                "RDZV_ENDPOINT and RDZV_ID, or raise RDZV_TIMEOUT if they start later than that")
    cause = e.__cause__ or e.__context__
    detail = (str(cause).splitlines() or [""])[0] if cause is not None else ""
    detail = detail or (str(e).splitlines() or [type(e).__name__])[0]
    return (f"{where} ({type(e).__name__}: {detail[:300]}); check that node 0 (NODE_RANK=0) runs there, that its port "
            "is free and reachable from every node, and that every node has the same NNODES and RDZV_ID")


def _lost_nodes(lost: list[tuple[int, str]]) -> str:
    names = [f"NODE_RANK {rank} (host {host})" for rank, host in lost]
    return f"node {names[0]}" if len(names) == 1 else f"nodes {', '.join(names)}"


def _watch_rendezvous(args: argparse.Namespace) -> RendezvousWatch | None:
    """A RendezvousWatch for a multi-node c10d launch from run_llama_train.sh (which exports
    NODE_RANK); None for one node, or for an elastic MIN:MAX node count."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.nnodes.isdigit() or int(args.nnodes) < 2:
        return None
    if not os.environ.get("NODE_RANK", "").isdigit() or ":" not in args.rdzv_endpoint:
        return None
    interval = float(os.environ.get("RDZV_PROGRESS_INTERVAL") or PROGRESS_INTERVAL_SECONDS)
    return RendezvousWatch(args, int(os.environ["NODE_RANK"]), interval)


def main(argv: list[str]) -> int:
    launched = time.time()  # before torch's import: the ranks' start-up counts from here (observability/goodput.py)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    os.environ[LAUNCH_TIME_ENV] = str(launched)  # the ranks inherit it: start-up includes the rendezvous and spawn
    args = get_args_parser().parse_args(argv)
    if not args.standalone and args.nnodes != "1":
        # Every rendezvous round gets a store of its own, hosted by that round's rank 0, instead of
        # the one torchrun's first round opened on its rank-0 node: a node replaced after a loss
        # joins with a restart count of 0 while the survivors count 1, so no key derived from the
        # count is shared (process_group.py), and the first round's store may have been on the lost
        # node. torch reads this variable (dynamic_rendezvous.py, since 2.4).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
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
        watch = _watch_rendezvous(args)
        if watch is not None:
            watch.start()
        try:
            run(args)
        except ChildFailedError as e:
            exit_codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        except SignalException as e:
            signum = int(e.sigval)  # the agent has passed it on and waited for the ranks to stop
        except RendezvousError as e:  # the nodes never met, or a node lost later never came back
            if own_logs:
                shutil.rmtree(args.log_dir, ignore_errors=True)
            line = _rendezvous_failure(args, e, watch)
            if watch is not None:
                watch.stop()
            print(f"error: {line}", file=sys.stderr, flush=True)
            return EXIT_USER
        finally:
            done.set()
            killer.join()
        reports = read_reports(folder)
        code, text = summarize(reports, exit_codes, signum)
        if watch is not None:
            lost = watch.lost() if code != 0 and not signum else []
            watch.stop()
            if lost:  # a peer's collective failed because a whole node went: say which
                text += f" ({_lost_nodes(lost)} stopped: its launcher is gone with its ranks)"
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
