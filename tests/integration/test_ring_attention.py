"""Ring attention (context parallelism) is exact: on cp = 2 and 4 gloo ranks, with and without
grouped-query attention, with the CPU flash kernels and with the plain-matmul kernels, the output
and the q/k/v gradients of each rank's load-balanced shard equal those of full causal attention
over the whole sequence on one device (computed in float64), to fp32 tolerance."""

import pytest

from tests.helpers import run_ranks_script

SCRIPT = r'''
import json
import torch
import torch.distributed as dist
from torchtitan.runtime.process_group import exit_process
from torchtitan.parallelisms.ring_attention import ring_attention, shard_sequence, unshard_sequence

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
errors = {}
for name, heads, kv_heads, kernel in (("mha_flash", 4, 4, "cpu_flash"), ("gqa_flash", 4, 2, "cpu_flash"),
                                      ("mha_matmul", 4, 4, "math"), ("gqa_matmul", 4, 1, "math")):
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, seq, dim = 2, 12 * cp, 8
    q, dout = torch.randn(batch, heads, seq, dim), torch.randn(batch, heads, seq, dim)
    k, v = torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)

    # Reference: full causal attention on one device, in float64.
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    groups = heads // kv_heads
    scores = ref[0] @ ref[1].repeat_interleave(groups, 1).transpose(-1, -2) * dim**-0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    ref_out = scores.softmax(-1) @ ref[2].repeat_interleave(groups, 1)
    ref_out.backward(dout.double())

    local = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group=dist.group.WORLD, kernel=kernel)
    out.backward(shard_sequence(dout, rank, cp, dim=2))
    pairs = [(out, ref_out)] + [(mine.grad, full.grad) for mine, full in zip(local, ref)]
    err = torch.tensor([(a.double() - shard_sequence(b.detach(), rank, cp, dim=2)).abs().max().item()
                        for a, b in pairs], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    errors[name] = dict(zip(("out", "dq", "dk", "dv"), err.tolist()))

# The shard/unshard pair is a permutation of the sequence and its inverse.
x = torch.arange(4 * cp).view(1, -1)
parts = [shard_sequence(x, r, cp) for r in range(cp)]
errors["roundtrip"] = bool(torch.equal(unshard_sequence(parts), x))
errors["rank0_chunks"] = parts[0].tolist()
if rank == 0:
    print("RESULT " + json.dumps(errors))
dist.destroy_process_group()
# Skip interpreter finalization, where gloo's threads can abort a finished rank (see exit_process).
exit_process(0)
'''


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_causal_attention(tmp_path, cp):
    result = run_ranks_script(SCRIPT, cp, tmp_path)
    assert result.pop("roundtrip") is True
    # Rank 0 holds the first and the last of the 2 x cp chunks (two positions each here).
    assert result.pop("rank0_chunks") == [[0, 1, 4 * cp - 2, 4 * cp - 1]]
    for case, errs in result.items():
        print(f"cp {cp} {case}: max abs error {errs}")
        for what, err in errs.items():
            assert err < 2e-5, (case, what, err)
