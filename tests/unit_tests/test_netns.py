"""Simulated hosts (tests/machinery/namespaces.py) when `ip` refuses a step: a one-line error that
names the command, and nothing left behind. `ip` is a stand-in here; building real namespaces (root,
iproute2) is tested by tests/integration/test_multinode.py."""

import subprocess

import pytest

from tests.machinery import namespaces as netns


def test_a_refused_step_removes_what_was_built_and_names_the_command(monkeypatch):
    calls = []

    def ip(*args, check=True):
        calls.append(args)
        if args[:2] == ("link", "add"):
            raise subprocess.CalledProcessError(2, ["ip", *args], stderr="RTNETLINK answers: Operation not permitted\n")
        return subprocess.CompletedProcess(["ip", *args], 0, "", "")

    monkeypatch.setattr(netns, "_ip", ip)
    hosts = netns.TwoHosts()
    with pytest.raises(RuntimeError) as e, hosts:
        pass
    assert str(e.value) == (f"could not build 2 network namespaces: ip link add {hosts.interfaces[0]} type veth peer "
                            f"name {hosts.ports[0]}: RTNETLINK answers: Operation not permitted")
    added = [("netns", "add", hosts.switch), ("netns", "add", hosts.namespaces[0])]  # up to the refused step
    deleted = [("netns", "del", ns) for ns in (*hosts.namespaces, hosts.switch)]
    assert calls[-len(deleted):] == deleted and all(call in calls for call in added)
