"""Context-parallel attention is exact: on cp = 2 and 4 gloo ranks, for both methods (ring and
all-gather), with and without grouped-query attention, with the CPU flash kernels and with the
plain-matmul kernels, the output and the q/k/v gradients of each rank's load-balanced shard equal
those of attention over the whole sequence on one device (computed in float64), to fp32 tolerance.

Document masking: packed sequences whose documents start inside chunks, across chunk borders and
at a chunk's first position, different in each batch row, with small tiles so that blocks are
skipped, masked and merged; the reference masks attention to each query's own document. One case
per method runs the compiled path (the custom operators inside a fullgraph torch.compile, aot_eager).

gpt-oss's attention: sinks (one logit per head in every softmax's denominator; their gradient
summed over the ranks' queries) and a window shorter than a chunk, alone and beside documents, so
that the ring skips whole key blocks and masks those the band cuts; compiled too."""

import pytest
import torch

from tests.helpers import run_ranks_script
from tests.tolerances import largest_difference

SCRIPT = r'''
import json
import torch
import torch.distributed as dist
from torchtitan.runtime.process_group import exit_process
from torchtitan.parallelisms.cp_attention import cp_attention, register_group, ring_attention
from torchtitan.parallelisms.ring_attention import shard_sequence, unshard_sequence

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
group = register_group(dist.group.WORLD)
errors = {}
seq = 12 * cp
# Document ids per batch row: boundaries inside chunks (length 6), on a chunk's first position, one
# long document; row 1 is a single document but for one short one at the end.
docs = torch.zeros(2, seq, dtype=torch.int32)
for start in (5, 6, 19, 20, 21, seq - 7):
    docs[0, start:] += 1
docs[1, seq - 3:] = 1


def reference(q, k, v, dout, documents, window=None, sinks=None):
    ref = [t.double().requires_grad_() for t in (q, k, v) + (() if sinks is None else (sinks,))]
    groups = q.shape[1] // k.shape[1]
    scores = ref[0] @ ref[1].repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1]**-0.5
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if window is not None:  # key j seen by query i iff i - window < j
        allowed &= torch.arange(seq).unsqueeze(0) > torch.arange(seq).unsqueeze(1) - window
    if documents is not None:
        allowed = allowed & (documents.unsqueeze(2) == documents.unsqueeze(1)).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more column per head, the sink's logit, whose value is zero
        scores = torch.cat([scores, ref[3].view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :seq]
    out = probs @ ref[2].repeat_interleave(groups, 1)
    out.backward(dout.double())
    return [out] + [t.grad for t in ref]


cases = [(f"{method}_{name}", method, heads, kv_heads, kernel, documents, 4, window)
         for method in ("ring", "allgather")
         for name, heads, kv_heads, kernel, documents, window in (
             ("mha_flash", 4, 4, "cpu_flash", None, None), ("gqa_flash", 4, 2, "cpu_flash", None, None),
             ("mha_matmul", 4, 4, "math", None, None), ("gqa_matmul", 4, 1, "math", None, None),
             ("docs_gqa_flash", 4, 2, "cpu_flash", docs, None), ("docs_mha_matmul", 4, 4, "math", docs, None),
             # gpt-oss: sinks, and a window shorter than a chunk (6) and than a rank's share (12).
             ("window_sinks_gqa_flash", 4, 2, "cpu_flash", None, 5),
             ("docs_window_sinks_matmul", 4, 4, "math", docs, 7),
             ("docs_one_tile", 4, 2, "cpu_flash", docs, None))]
cases[-1] = cases[-1][:-2] + (512, None)  # tiles as large as the chunks: masked blocks only
for name, method, heads, kv_heads, kernel, documents, tile, window in cases:
    torch.manual_seed(0)  # the same full tensors on every rank
    dim = 8
    q, dout = torch.randn(2, heads, seq, dim), torch.randn(2, heads, seq, dim)
    k, v = torch.randn(2, kv_heads, seq, dim), torch.randn(2, kv_heads, seq, dim)
    sinks = torch.randn(heads) if "sinks" in name else None
    expected = reference(q, k, v, dout, documents, window, sinks)
    local = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = cp_attention(*local, documents, group_name=group, method=method, kernel=kernel, tile=tile,
                       sinks=local_sinks, window=window)
    out.backward(shard_sequence(dout, rank, cp, dim=2))
    got = [out] + [t.grad for t in local]
    err = [(a.double() - shard_sequence(b.detach(), rank, cp, dim=2)).abs().max().item() for a, b in zip(got, expected)]
    if sinks is not None:
        # Each rank's sink gradient is its queries' share: summed over the ranks, the whole one's.
        dsinks = local_sinks.grad.double()
        dist.all_reduce(dsinks)
        err.append((dsinks - expected[4]).abs().max().item())
    err = torch.tensor(err, dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    errors[name] = dict(zip(("out", "dq", "dk", "dv", "dsinks"), err.tolist()))
    errors[name]["scale"] = max(t.abs().max().item() for t in expected)

# The compiled path: the custom operators inside a fullgraph graph, against the eager function, for
# both methods (the all-gather's key and value gradients come out of one reduce-scattered buffer,
# which an operator may not return as two views of it).
torch.manual_seed(1)
q, k, v, dout = (shard_sequence(torch.randn(2, 4, seq, 8), rank, cp, dim=2) for _ in range(4))
same = []
sinks = torch.randn(4)
for method, window in (("ring", None), ("allgather", None), ("ring", 5)):
    def attend(q, k, v, s, method=method, window=window):
        return cp_attention(q, k, v, docs, group_name=group, method=method, tile=4, window=window,
                            sinks=None if window is None else s) * 2

    results = []
    for fn in (torch.compile(attend, backend="aot_eager", fullgraph=True), attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves[:3]] + ([leaves[3].grad] if window else []))
    same.append(all(torch.equal(a, b) for a, b in zip(*results)))
errors["compiled_bitwise"] = all(same)

# The plain ring_attention entry point still takes a process group.
ring = ring_attention(q, k, v, dist.group.WORLD)
errors["ring_entry"] = bool(torch.equal(ring, cp_attention(q, k, v, group_name=group)))

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
def test_cp_attention_matches_full_attention(tmp_path, cp):
    result = run_ranks_script(SCRIPT, cp, tmp_path)
    assert result.pop("roundtrip") is True
    assert result.pop("compiled_bitwise") is True
    assert result.pop("ring_entry") is True
    # Rank 0 holds the first and the last of the 2 x cp chunks (two positions each here).
    assert result.pop("rank0_chunks") == [[0, 1, 4 * cp - 2, 4 * cp - 1]]
    assert len(result) == 18
    # fp32 against float64: the scores' sums over the head dim (8), the softmax's and the weighted
    # sum's over the sequence (12 cp), the backward's over those again (three over the sequence), the
    # key/value heads' groups (up to 4) and the merges of the cp ranks' blocks (a sink's gradient sums
    # over the batch's rows too, 2 x seq terms, and over the cp ranks).
    seq = 12 * cp
    terms = 8 + 2 * seq + 8 + 3 * seq + 4 + 2 * cp
    for case, errs in result.items():
        print(f"cp {cp} {case}: max abs error {errs}")
        bound = largest_difference(torch.float32, terms + (2 * seq if "dsinks" in errs else 0), errs.pop("scale"))
        for what, err in errs.items():
            assert err < bound, (case, what, err, bound)
