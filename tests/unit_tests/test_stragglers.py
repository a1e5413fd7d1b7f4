"""Naming the node that slows a multi-node job (torchtitan/observability/stragglers.py): the link
probe's attribution, from per-node receive times, without a process group. The probes themselves
run in the simulated-cluster test (tests/integration/test_sim_cluster.py) and scripts/sim_cluster.py."""

import pytest

from torchtitan.observability.stragglers import SLOW_FLOOR_SECONDS, SlowRank, Topology, slowest_link, slowest_node

pytestmark = pytest.mark.fast

FAST, SLOW = 0.0004, 0.015  # seconds for the probe's 64 KiB: a quiet link, and one throttled


def _topology(nodes: int) -> Topology:
    return Topology(world=4 * nodes, per_node=4, hosts=tuple(f"10.0.0.{n + 1}" for n in range(nodes)))


def test_a_slow_outgoing_link_is_blamed_on_its_node_not_on_its_neighbours():
    # Node 2 sends slowly: node 3 receives late from its left, node 1 late from its right.
    link = slowest_link(_topology(4), [FAST, FAST, FAST, SLOW], [FAST, SLOW, FAST, FAST])
    assert (link.node, link.host, link.direction, link.stands_out) == (2, "10.0.0.3", "outgoing", True)
    assert link.text() == "slow link: node 2 (10.0.0.3) outgoing: 256 KiB in 15.0 ms vs median 0.4 ms (38x)"


def test_a_slow_incoming_link_is_blamed_on_the_node_whose_both_receives_are_late():
    link = slowest_link(_topology(8), [FAST, SLOW, *[FAST] * 6], [FAST, SLOW, *[FAST] * 6])
    assert (link.node, link.direction, link.stands_out) == (1, "incoming", True)


def test_links_alike_are_not_named_however_the_times_scatter():
    times = [FAST, 1.8 * FAST, FAST, 1.3 * FAST]
    assert not slowest_link(_topology(4), times, list(reversed(times))).stands_out
    # A factor over the median alone is not enough: the difference must pass the floor too.
    tiny = [1e-5, 1e-5, 1e-5, 9e-5]
    assert not slowest_link(_topology(4), tiny, tiny).stands_out
    assert SLOW_FLOOR_SECONDS > 9e-5


def test_two_nodes_name_the_link_between_them():
    link = slowest_link(_topology(2), [FAST, SLOW], [FAST, SLOW])
    assert (link.node, link.stands_out) == (-1, True)
    assert link.text().startswith("slow link: the link between 10.0.0.1 and 10.0.0.2: 256 KiB in 15.0 ms")


def test_a_slow_rank_is_described_by_its_node_and_host():
    topology = _topology(4)
    assert topology.node_of(9) == 2 and topology.describe(9) == "node 2, 10.0.0.3"
    assert Topology(world=4, per_node=4, hosts=("a",)).describe(3) == ""  # one node: nothing to place
    slow = SlowRank(9, topology.describe(9), 0.099, 0.004)
    assert slow.stands_out and not SlowRank(9, "", 0.0045, 0.004).stands_out
    assert slow.text() == ("slow compute: node 2, 10.0.0.3 (rank 9) 99.0 ms vs median node 4.0 ms for the same matmuls "
                           "(24.8x)")


def test_a_node_is_slow_when_its_median_rank_is_not_when_one_rank_is():
    topology = _topology(4)  # 4 ranks per node
    times = [0.004] * 16
    times[13] = 0.05  # one rank of node 3 descheduled for a while: noise, not a slow node
    assert not slowest_node(times, topology).stands_out
    for rank in (8, 9, 10):  # three of node 2's four ranks slow: the node is
        times[rank] = 0.09
    slow = slowest_node(times, topology)
    assert (slow.rank, slow.where, slow.stands_out) == (8, "node 2, 10.0.0.3", True)
    assert slow.seconds == pytest.approx(0.09) and slow.median_seconds == pytest.approx(0.004)
