"""ParallelDims.build_mesh on 4 gloo ranks: dim names, size-1 dims left out, flattened views, the
role meshes (what FSDP shards over, what replicas span, what the loss and the data are split
over) and data-parallel coordinates shared by tensor-parallel peers."""

from tests.helpers import run_ranks_script

SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from torchtitan.runtime.process_group import exit_process
from torchtitan.parallelisms.parallel_dims import ParallelDims

dist.init_process_group("gloo")
out = {}
ROLES = ("fsdp_mesh", "replicate_mesh", "loss_mesh", "data_mesh", "tp_mesh", "cp_mesh", "pp_mesh")
for name, degrees in {"hsdp": dict(dp_replicate=2, dp_shard=-1, cp=1, tp=1, pp=1),
                      "fsdp": dict(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1),
                      "replicate_cp": dict(dp_replicate=2, dp_shard=1, cp=2, tp=1, pp=1),
                      "shard_cp": dict(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1)}.items():
    dims = ParallelDims(**degrees, world_size=4, enable_loss_parallel=True)
    world = dims.build_mesh("cpu")
    views = {v: (m.size(), m.get_local_rank()) for v in ("dp", "dp_shard_cp", "dp_cp", "tp", "pp")
             if (m := dims.get_mesh(v)) is not None}
    roles = {r: {"names": list(m.mesh_dim_names), "shape": list(m.shape), "coordinate": m.get_coordinate()}
             for r in ROLES if (m := getattr(dims, r)) is not None}
    out[name] = {"names": list(world.mesh_dim_names), "shape": list(world.shape), "views": views, "roles": roles}
# Data-parallel coordinates with tp 2: ranks that differ only in tp must read the same data.
dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4, enable_loss_parallel=True)
dims.build_mesh("cpu")
dp_ranks = [None] * 4
dist.all_gather_object(dp_ranks, dims.get_mesh("dp").get_local_rank())
out["dp_rank_by_global_rank_with_tp2"] = dp_ranks
if dist.get_rank() == int(sys.argv[1]):
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
# Skip interpreter finalization, where gloo's threads can abort a finished rank (see exit_process).
exit_process(0)
"""


def test_named_mesh_and_flattened_views(tmp_path):
    out = run_ranks_script(SCRIPT, 4, tmp_path, "3", timeout=120)
    # Rank 3 is coordinate (1, 1) of the 2 x 2 (dp_replicate, dp_shard) mesh.
    assert out["hsdp"]["names"] == ["dp_replicate", "dp_shard"] and out["hsdp"]["shape"] == [2, 2]
    assert out["hsdp"]["views"] == {"dp": [4, 3], "dp_shard_cp": [2, 1], "dp_cp": [4, 3]}
    hsdp = out["hsdp"]["roles"]
    assert hsdp["fsdp_mesh"] == {"names": ["dp_replicate", "dp_shard_cp"], "shape": [2, 2], "coordinate": [1, 1]}
    assert hsdp["replicate_mesh"]["shape"] == [2] and set(hsdp) == {"fsdp_mesh", "replicate_mesh", "loss_mesh", "data_mesh"}
    # Size-1 dims (dp_replicate, cp, tp, pp) are left out of the mesh.
    assert out["fsdp"]["names"] == ["dp_shard"] and out["fsdp"]["shape"] == [4]
    assert out["fsdp"]["views"] == {"dp": [4, 3], "dp_shard_cp": [4, 3], "dp_cp": [4, 3]}
    assert out["fsdp"]["roles"]["fsdp_mesh"] == {"names": ["dp_shard_cp"], "shape": [4], "coordinate": [3]}
    assert "replicate_mesh" not in out["fsdp"]["roles"]
    # Replicas x context parallel (the layout that once failed): FSDP shards over the cp peers and
    # replicates over dp_replicate; the loss spans all 4 ranks, the data only the 2 replicas.
    rcp = out["replicate_cp"]["roles"]
    assert rcp["fsdp_mesh"] == {"names": ["dp_replicate", "dp_shard_cp"], "shape": [2, 2], "coordinate": [1, 1]}
    assert rcp["loss_mesh"]["shape"] == [4] and rcp["data_mesh"]["shape"] == [2] and rcp["cp_mesh"]["shape"] == [2]
    # Sharding x context parallel: one FSDP group of all 4 ranks, data split in 2.
    scp = out["shard_cp"]["roles"]
    assert scp["fsdp_mesh"] == {"names": ["dp_shard_cp"], "shape": [4], "coordinate": [3]}
    assert scp["data_mesh"]["shape"] == [2] and "replicate_mesh" not in scp
    # tp is the innermost dim: global ranks (0, 1) and (2, 3) are tp peers sharing a data rank, so
    # the loader (built from the dp coordinate alone) gives them identical batches.
    assert out["dp_rank_by_global_rank_with_tp2"] == [0, 0, 1, 1]
