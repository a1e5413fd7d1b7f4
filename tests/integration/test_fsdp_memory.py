"""What each rank holds under data parallelism, measured on the layout matrix's runs (no runs of
its own): parameters are split over the ranks that shard them (dp_shard x cp); optimizer state is
split over those and, with ZeRO-1, over the replicas too; plain DDP keeps a full copy.

The counts come from the runs' setup records (torchtitan/observability/setup_record.py): every rank's parameter
and optimizer-state bytes after its first step, gathered once on rank 0.
"""

import pytest

from tests.integration.test_layout_matrix import marks
from tests.machinery.layout_matrix import ci_points

MIB = 2**20
# Data-parallel points only: TP and PP split the model itself, by other rules.
DATA_PARALLEL = [p for p in ci_points() if p.nproc > 1 and not p.refused_by_design and not p.on("groups")
                 and set(p.degrees.active) <= {"dp_replicate", "dp_shard", "cp"}]


def held_per_rank(setup: dict) -> dict[int, tuple[float, float]]:
    """{rank: (parameter MiB, optimizer-state MiB)}."""
    return {r["rank"]: (r["parameter_bytes"] / MIB, r["optimizer_state_bytes"] / MIB) for r in setup["ranks"]}


@pytest.mark.fast
def test_the_points_cover_fsdp_hsdp_and_zero1():
    kinds = {("zero1" if p.value("zero1") == "on" else "hsdp" if p.degrees.dp_replicate > 1 and
              p.degrees.dp_shard * p.degrees.cp > 1 else "ddp" if p.degrees.dp_replicate > 1 else "fsdp")
             for p in DATA_PARALLEL}
    assert {"fsdp", "hsdp", "zero1"} <= kinds, kinds


# Marked as the matrix test marks the same points: the fast tier reads the records of the points it
# runs anyway, and a compiled point has a reason to take long (it runs here first).
@pytest.mark.parametrize("point", [pytest.param(p, marks=marks(p)) for p in DATA_PARALLEL],
                         ids=[p.name for p in DATA_PARALLEL])
def test_each_rank_holds_its_share(matrix, point):
    outcome = matrix.check(point)
    (total_params, total_state), = held_per_rank(matrix.harness.baseline(point.shared(), point.model_args()).setup).values()
    held = held_per_rank(outcome.comparison.run.setup)
    assert sorted(held) == list(range(point.nproc)), held
    d = point.degrees
    shards = d.dp_shard * d.cp
    state_shards = shards * (d.dp_replicate if point.value("zero1") == "on" else 1)
    # FSDP shards each tensor (the last rank's share can be short); ZeRO-1 hands out whole tensors,
    # so its shares are even up to the largest tensor's state (the embedding: 2 x 2256 x 128 x 4 B).
    largest_state = 2 * 2256 * 128 * 4 / 2**20 if state_shards > shards else 0.0
    for rank, (params, state) in held.items():
        print(f"{point.name} rank {rank}: parameters {params:.3f} of {total_params:.3f} MiB (1/{shards}), "
              f"optimizer state {state:.3f} of {total_state:.3f} MiB (1/{state_shards})")
        assert abs(params - total_params / shards) <= 0.1 * total_params / shards, (rank, params)
        assert abs(state - total_state / state_shards) <= 0.1 * total_state / state_shards + largest_state, (rank, state)
    # Nothing is lost: the shares add up to the whole (each replica group holds it all once).
    groups = d.dp_replicate if state_shards == shards else 1
    assert sum(s for _, s in held.values()) == pytest.approx(groups * total_state, rel=1e-3)
