"""Simulated hosts (tests/machinery/namespaces.py) when `ip` refuses a step: a one-line error that
names the command, and nothing left behind. `ip` is a stand-in here; building real namespaces (root,
iproute2) is tested by tests/integration/test_sim_cluster.py."""

import os
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


def test_leftovers_are_only_the_hosts_of_processes_that_are_gone(monkeypatch):
    gone, mine = 2**22 + 1, os.getpid()  # above Linux's largest pid: no such process
    listed = [f"ttns{gone}r5h0", f"ttns{gone}r5sw", f"ttns{mine}r7h0 (id: 3)", "ttnsprobe12", "other"]
    calls = []

    def ip(*args, check=True):
        calls.append(args)
        return subprocess.CompletedProcess(["ip", *args], 0, "\n".join(listed) if args == ("netns", "list") else "", "")

    monkeypatch.setattr(netns, "_ip", ip)
    netns.remove_leftovers()
    assert [c for c in calls if c[:2] == ("netns", "del")] == [("netns", "del", f"ttns{gone}r5h0"),
                                                              ("netns", "del", f"ttns{gone}r5sw")]
