"""Multi-node launch on two simulated hosts: network namespaces joined by a veth pair, each with
its own address, running run_llama_train.sh as node 0 and node 1 of one job (NNODES=2, c10d
rendezvous at host 0's address, 2 ranks per host). FSDP over 4 ranks and HSDP 2 x 2 with the
replicas across the hosts train like one process (the parity harness's seed checkpoint, global
batch and tolerances)."""

import pytest

from tests.machinery.netns import run_on_two_hosts, two_hosts
from tests.machinery.warm_launcher import run_warm
from torchtitan.tools.parity import Layout, ParityHarness

LAYOUTS = {
    "fsdp4_over_2_hosts": Layout("fsdp4_over_2_hosts", 4, ("--training.data_parallel_shard_degree", "4"),
                                 expect=(("fsdp.mesh", {"dp_shard_cp": 4}), ("world_size", 4))),
    # Ranks 0-1 on one host, 2-3 on the other (torchrun keeps a node's ranks contiguous), and the
    # replicate dim is the outer one: each replica's shards on one host, the replicas across hosts.
    "hsdp2x2_over_2_hosts": Layout("hsdp2x2_over_2_hosts", 4, ("--training.data_parallel_replicate_degree", "2",
                                                               "--training.data_parallel_shard_degree", "2"),
                                   expect=(("fsdp.mesh", {"dp_replicate": 2, "dp_shard_cp": 2}), ("world_size", 4))),
}

hosts = pytest.fixture(scope="module")(two_hosts)


@pytest.fixture(scope="module")
def across_hosts(parity, hosts):
    """A parity harness whose multi-rank runs go to the two hosts; it shares the session
    harness's seed checkpoint and single-process baseline."""
    def runner(args, nproc=1, timeout=400, check=True, extra_env=None):
        if nproc == 1:
            return run_warm(args, nproc=1, timeout=timeout, check=check, extra_env=extra_env)
        return run_on_two_hosts(hosts, args, nproc, timeout, extra_env)

    harness = ParityHarness(parity.workdir, steps=parity.steps, runner=runner, base_args=parity.base_args)
    harness._runs["baseline"] = parity.baseline()
    return harness


@pytest.mark.parametrize("name", LAYOUTS)
def test_two_hosts_train_like_one_process(across_hosts, name):
    result = across_hosts.check(LAYOUTS[name])
    print(f"{name}: max |loss diff| {result.max_loss_diff:.3e}, final grad norm rel diff "
          f"{result.grad_norm_rel_diff:.3e}")
    assert result.max_loss_diff <= across_hosts.loss_tolerance
    # Both hosts' launchers ran their two ranks: node 0's local ranks are global 0-1, node 1's 2-3.
    ranks = [r["rank"] for r in result.run.setup["ranks"]]
    assert ranks == [0, 1, 2, 3]
