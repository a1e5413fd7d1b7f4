"""The tensor-parallel plan's communication, counted with PyTorch's CommDebugMode on 2 gloo ranks.

One transformer block forward must issue exactly one all-gather before each column-wise pair
(attention, feed-forward) and one reduce-scatter after each row-wise projection with sequence
parallelism, or one all-reduce per row-wise projection without it. A plan change that adds,
drops or converts a collective fails here. The block's output must also equal the unsharded
block's, so the counts belong to a correct plan.
"""

import torch

from tests.helpers import run_ranks_script
from tests.tolerances import largest_difference, transformer_sums

SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.parallelize_llama import apply_tp
from torchtitan.runtime.process_group import exit_process

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
rank = dist.get_rank()
torch.manual_seed(0)
args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)
reference = Transformer(args)
reference.init_weights()
x = torch.randn(2, 16, 64)
expected = reference.layers["0"](x, reference.rope_cache)
out = {}
for sp in (True, False):
    model = copy.deepcopy(reference)
    apply_tp(model, mesh, loss_parallel=True, sequence_parallel=sp)
    local_x = x.chunk(2, dim=1)[rank] if sp else x  # with SP each rank holds half of the sequence
    with CommDebugMode() as comm:
        y = model.layers["0"](local_x, model.rope_cache)
    full = y.full_tensor() if hasattr(y, "full_tensor") else y
    if sp:
        parts = [torch.empty_like(y) for _ in range(2)]
        dist.all_gather(parts, y.contiguous())
        full = torch.cat(parts, dim=1)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    out["sp" if sp else "no_sp"] = {"counts": counts, "max_err": (full - expected).abs().max().item()}
out["branches"] = (expected - x).abs().max().item()  # what the block adds to its input
out["largest"] = expected.abs().max().item()
if rank == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
# Skip interpreter finalization, where gloo's threads can abort a finished rank (see exit_process).
exit_process(0)
"""


def test_block_forward_collectives_under_tp2(tmp_path):
    out = run_ranks_script(SCRIPT, 2, tmp_path)
    print(out)
    # Sequence parallel: all-gather before attention and before the feed-forward, reduce-scatter after each.
    assert out["sp"]["counts"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, out["sp"]
    # Without it: activations stay replicated, and each row-wise projection ends in an all-reduce.
    assert out["no_sp"]["counts"] == {"all_reduce": 2}, out["no_sp"]
    # The sharded projections sum their halves apart, then add them: the block's sums reordered, at
    # the scale of what the block adds, and the residual sum's own rounding.
    block_sums = transformer_sums(n_layers=1, dim=64, hidden=176, seq=16, head_dim=16) - 2 * 64
    bound = largest_difference(torch.float32, block_sums, out["branches"]) + torch.finfo().eps * out["largest"]
    assert out["sp"]["max_err"] < bound and out["no_sp"]["max_err"] < bound, (out, bound)
