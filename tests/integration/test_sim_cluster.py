"""The smallest simulated-cluster scenario (scripts/sim_cluster.py): 8 ranks on 4 simulated hosts,
one launcher each, train a 4-D MoE layout (PP 2 x FSDP 2 x TP 2, EP 2) like one process, while one
host's outgoing link is rate-limited and the step lines name that host (the link probe,
torchtitan/observability/stragglers.py). The 32-rank scenarios, start-up and the failures at that
size are measured by the script (docs/operations.md)."""

import pytest

from scripts import sim_cluster
from tests.machinery.netns import run_on_hosts, simulated_hosts
from tests.machinery.warm_launcher import run_warm
from torchtitan.tools.parity import ParityHarness

SLOW_HOST = 2

hosts = pytest.fixture(scope="module")(lambda: (yield from simulated_hosts(4)))


@pytest.mark.budget("8 ranks of 4 launchers on 4 simulated hosts (a rendezvous, 8 processes importing torch on 2 "
                    "cores), 6 steps of a 4-D MoE layout through a rate-limited link; about 30 s")
def test_eight_ranks_on_four_hosts_train_like_one_process_and_name_the_slowed_link(parity, hosts):
    def runner(args, nproc=1, timeout=600, check=True, extra_env=None):
        if nproc == 1:  # the seed and the baseline: the session's, shared with the parity suite
            return run_warm(args, nproc=1, timeout=timeout, check=check, extra_env=extra_env)
        return run_on_hosts(hosts, args, nproc, timeout, extra_env)

    harness = ParityHarness(parity.workdir, steps=parity.steps, runner=runner, base_args=parity.base_args)
    harness._runs = parity._runs  # the session's cached runs: one seed checkpoint and baseline per model
    hosts.slow_link(SLOW_HOST, 200)  # Mbit/s out of host 2: the probe's 256 KiB take 10 ms, the numerics do not change
    scenario = sim_cluster.SCENARIOS["moe4d-8"]
    result = harness.check(scenario.layout())
    print(f"{scenario.name}: max |loss diff| {result.max_loss_diff:.3e}, final grad norm rel diff "
          f"{result.grad_norm_rel_diff:.3e}")
    ranks = [r["rank"] for r in result.run.setup["ranks"]]
    assert ranks == list(range(8))
    named = [line for line in result.run.stdout.splitlines() if "slow link:" in line]
    assert named, "no step line named a slow link"
    address = hosts.addresses[SLOW_HOST]
    assert all(f"({address}) outgoing" in line for line in named), named
