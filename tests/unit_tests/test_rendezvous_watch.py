"""The launcher's rendezvous watch (torchtitan/runtime/launch.py, issue 37) against a real TCPStore in this
process: the waiting lines name the missing NODE_RANKs, stop once every node has arrived, and the
error at RDZV_TIMEOUT names who never came."""

import argparse
import re
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from torchtitan.runtime import launch
from torchtitan.runtime.launch import RendezvousWatch, _rendezvous_failure

pytestmark = pytest.mark.fast


def _args(port: int, nnodes: int, conf: str = "is_host=1,join_timeout=6") -> argparse.Namespace:
    return argparse.Namespace(rdzv_endpoint=f"127.0.0.1:{port}", nnodes=str(nnodes), rdzv_id="watch-test",
                              rdzv_conf=conf)


@pytest.fixture(autouse=True)
def _no_ranks_started(monkeypatch):
    """The watch also ends once its launcher has child processes (the ranks); this process's
    children, if any, are the test suite's (its warm launcher), not ranks."""
    monkeypatch.setattr(launch, "_started_ranks", lambda: False)


@pytest.fixture
def store():
    """Node 0's store, as torchrun opens it: in this process, which the node-0 watch checks for."""
    return TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))


def _wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_lines_name_the_missing_nodes_until_all_arrive(store, capsys):
    node0 = RendezvousWatch(_args(store.port, 3), node_rank=0, interval=0.2)
    node0.start()
    _wait_for(lambda: node0.arrivals is not None)
    node2 = RendezvousWatch(_args(store.port, 3), node_rank=2, interval=0.2)
    node2.start()
    _wait_for(lambda: node0.arrivals is not None and len(node0.arrivals) == 2)
    time.sleep(0.5)
    lines = _lines(capsys)
    found = [re.fullmatch(r"waiting: (\d) of 3 nodes at the rendezvous RDZV_ENDPOINT=127\.0\.0\.1:\d+ after \d+ s, "
                          r"missing NODE_RANK ([\d, ]+); the wait ends after RDZV_TIMEOUT=6 s", ln) for ln in lines]
    assert all(found) and found[-1].groups() == ("2", "1"), lines
    assert all(m.groups() in (("1", "1, 2"), ("2", "1")) for m in found), lines
    node1 = RendezvousWatch(_args(store.port, 3), node_rank=1, interval=0.2)
    node1.start()
    for watch in (node0, node1, node2):  # every node's watch falls silent once all three are there
        _wait_for(lambda w=watch: w.met)
    _lines(capsys)
    time.sleep(0.5)
    assert _lines(capsys) == []
    assert sorted(rank for rank, _ in node1.arrivals) == [0, 1, 2]
    for watch in (node0, node1, node2):  # and beats until its launcher stops it
        assert watch._thread.is_alive()
        watch.stop()
        assert not watch._thread.is_alive()


def test_a_node_whose_beat_stops_is_named_lost_and_one_that_left_is_not(store, monkeypatch):
    monkeypatch.setattr(launch, "HEARTBEAT_SECONDS", 0.1)
    node0 = RendezvousWatch(_args(store.port, 4), node_rank=0, interval=0.2)
    node2 = RendezvousWatch(_args(store.port, 4), node_rank=2, interval=0.2)
    # Node 1 beat once and went silent, as a machine that lost power; node 3 ended on its own.
    store.append("torchtitan/rendezvous/watch-test/arrivals", "1 host-a\n3 host-b\n")
    store.set("torchtitan/rendezvous/watch-test/alive/1", "7 10.0.0.2")
    store.set("torchtitan/rendezvous/watch-test/alive/3", "left 10.0.0.4")
    for watch in (node0, node2):
        watch.start()
    _wait_for(lambda: node0.met and node2.met)
    assert node0.lost() == [(1, "10.0.0.2")]
    assert node2.lost() == [(1, "10.0.0.2")]
    line = _rendezvous_failure(_args(store.port, 4, "is_host=1,join_timeout=30"), RendezvousTimeoutError(), node0)
    assert line.startswith("node NODE_RANK 1 (host 10.0.0.2) left the job and did not come back within "
                           "RDZV_TIMEOUT=30 s"), line
    node2.stop()  # ends on its own: the others do not count it lost
    time.sleep(5 * launch.HEARTBEAT_SECONDS)
    assert node0.lost() == [(1, "10.0.0.2")]
    node0.stop()


def test_the_same_node_rank_twice_is_said(store, capsys):
    first = RendezvousWatch(_args(store.port, 3), node_rank=0, interval=0.2)
    second = RendezvousWatch(_args(store.port, 3), node_rank=0, interval=0.2)
    first.start()
    second.start()
    _wait_for(lambda: any("came from" in ln for ln in capsys.readouterr().err.splitlines()))
    first.stop()
    second.stop()
    assert first.missing() == [1, 2]


def test_nothing_is_said_after_stop(store, capsys):
    watch = RendezvousWatch(_args(store.port, 2), node_rank=0, interval=0.1)
    watch.start()
    _wait_for(lambda: watch.arrivals is not None)
    watch.stop()
    _lines(capsys)
    time.sleep(0.3)
    assert _lines(capsys) == [] and not watch._thread.is_alive()


def test_a_store_not_yet_open_is_said_without_touching_it(capsys):
    """Node 1 before node 0 is up: the endpoint's port is free, so nothing answers there."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    watch = RendezvousWatch(_args(port, 2, "is_host=0"), node_rank=1, interval=0.3)
    watch.start()
    _wait_for(lambda: watch._thread.is_alive() and "not open" in capsys.readouterr().err)
    watch.stop()
    assert watch.arrivals is None


def test_a_store_that_holds_something_else_ends_the_watch_quietly(store, capsys):
    """What answers at the endpoint is not what the launchers write there (here: a key of another
    format): the watch ends without a line or a traceback, and torchrun's own error says the rest."""
    store.set("torchtitan/rendezvous/watch-test/arrivals", "node-zero somewhere\n")
    watch = RendezvousWatch(_args(store.port, 2, "is_host=0"), node_rank=1, interval=0.2)
    watch.start()
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive() and watch.arrivals is None
    assert capsys.readouterr().err == ""


def test_node_0_gone_while_waiting_ends_the_watch_quietly(capsys):
    """Node 0's store closes under a waiting node (node 0 failed): torchrun's own error ends the
    wait, so the watch stops reading without a line or a traceback."""
    node0 = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))
    watch = RendezvousWatch(_args(node0.port, 2, "is_host=0"), node_rank=1, interval=0.2)
    watch.start()
    _wait_for(lambda: watch.arrivals is not None)
    del node0  # the last reference: the store's server stops
    watch._thread.join(timeout=10)
    assert not watch._thread.is_alive()
    assert all(line.startswith("waiting: 1 of 2 nodes") for line in _lines(capsys))


def test_without_the_proc_socket_tables_node_0_reads_its_store_as_not_open(store, monkeypatch):
    """A kernel without /proc/self/net/tcp6 (no IPv6) or tcp: the store cannot be seen listening,
    so node 0's watch says the store is not open rather than failing."""
    real_open = open

    def no_tables(path, *args, **kwargs):
        if str(path).startswith("/proc/self/net/"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_open(path, *args, **kwargs)

    assert launch._listening_here(store.port)
    monkeypatch.setattr(launch, "open", no_tables, raising=False)
    assert not launch._listening_here(store.port)


def test_the_error_at_the_timeout_names_the_missing_nodes(store):
    args = _args(store.port, 12)
    watch = RendezvousWatch(args, node_rank=0, interval=60)
    watch.arrivals = [(0, "a"), (3, "b")]
    assert _rendezvous_failure(args, RendezvousTimeoutError(), watch) == (
        f"the 12 nodes did not meet at the rendezvous RDZV_ENDPOINT=127.0.0.1:{store.port} within RDZV_TIMEOUT=6 s "
        "(2 of 12 arrived, missing NODE_RANK 1, 2, 4, 5, 6, 7, 8, 9 and 2 more); start the missing nodes with the same "
        "NNODES, RDZV_ENDPOINT and RDZV_ID, or raise RDZV_TIMEOUT if they start later than that")
    watch.arrivals = None  # the store was never reached: no names
    assert "(not every node arrived)" in _rendezvous_failure(args, RendezvousTimeoutError(), watch)
    # Other rendezvous failures keep their cause and the hint about the endpoint.
    assert _rendezvous_failure(args, RendezvousConnectionError("refused"), watch).startswith(
        f"the 12 nodes did not meet at the rendezvous RDZV_ENDPOINT=127.0.0.1:{store.port} (RendezvousConnectionError: "
        "refused); check that node 0")
