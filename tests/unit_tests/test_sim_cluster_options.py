"""scripts/sim_cluster.py's refusals, in this process: no simulated hosts, and a straggler scenario
that slows nothing or two things at once. The scenarios themselves: tests/integration/test_sim_cluster.py."""

import pytest

from scripts import sim_cluster

pytestmark = pytest.mark.fast


def test_no_namespaces_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(sim_cluster, "unavailable", lambda: "network namespaces need root (this process is not)")
    assert sim_cluster.main(["startup"]) == 2
    assert capsys.readouterr().err == ("error: simulated hosts cannot be built here: network namespaces need root "
                                       "(this process is not)\n")


@pytest.mark.parametrize("argv", [["straggler"], ["straggler", "--link-mbit", "20", "--cpus", "0.5"]])
def test_a_straggler_scenario_slows_one_thing(monkeypatch, capsys, argv):
    monkeypatch.setattr(sim_cluster, "unavailable", lambda: None)
    monkeypatch.setattr(sim_cluster, "straggler", None)  # nothing may start
    assert sim_cluster.main(argv) == 2
    assert capsys.readouterr().err == "error: give one of --link-mbit and --cpus\n"


def test_the_startup_layouts_multiply_to_their_ranks():
    for ranks in (4, 8, 16, 32, 64):
        args = sim_cluster.startup_layout(ranks)
        degrees = [int(args[i + 1]) for i, a in enumerate(args) if a.endswith("_degree") and "expert" not in a]
        product = 1
        for d in degrees:
            product *= d
        assert product == ranks, (ranks, args)
