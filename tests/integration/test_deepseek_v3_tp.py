"""DeepSeek-V3's tensor-parallel plan gives every parameter one process's gradient, on 2 gloo ranks.

Multi-head latent attention shares one rotated key per token among all heads, and TP splits the
heads: each rank's gradient of that key is its heads' share, which must be summed over the tp ranks
before it reaches the replicated compression `wkv_a`. Without the sum the ranks' copies of `wkv_a`
drift apart from the first step (found as a resumed run that differed in the last bits: a checkpoint
keeps one rank's copy). Checked with compressed and full queries, with and without sequence
parallelism: every gradient equals the unsharded model's within reordered fp32 sums, and a
replicated parameter's gradient is bitwise the same on both ranks.
"""

import torch

from tests.helpers import run_ranks_script
from tests.tolerances import largest_difference, transformer_sums

SCRIPT = r"""
import copy, json
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.models.deepseek_v3 import DeepSeekV3, DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.parallelize_deepseek_v3 import apply_tp
from torchtitan.runtime.process_group import exit_process

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
torch.manual_seed(0)
tokens, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))


def gradients(model):
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


out = {}
for q_lora_rank in (0, 16):
    args = DeepSeekV3ModelArgs(dim=32, n_layers=1, n_dense_layers=1, n_heads=4, hidden_dim=48, vocab_size=64,
                               max_seq_len=16, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=6, mtp_depth=0)
    torch.manual_seed(1)
    reference = DeepSeekV3(args)
    reference.init_weights()
    sharded = copy.deepcopy(reference)
    expected = gradients(reference)
    for sp in (True, False):
        model = copy.deepcopy(sharded)
        apply_tp(model, mesh, loss_parallel=False, sequence_parallel=sp)
        case = {}
        for name, grad in gradients(model).items():
            full = grad.full_tensor() if isinstance(grad, DTensor) else grad
            spread = 0.0
            if isinstance(grad, DTensor) and grad.placements == (Replicate(),):
                copies = [torch.empty_like(grad.to_local()) for _ in range(2)]
                dist.all_gather(copies, grad.to_local().contiguous())
                spread = (copies[0] - copies[1]).abs().max().item()
            case[name] = {"err": (full - expected[name]).abs().max().item(), "scale": expected[name].abs().max().item(),
                          "spread": spread}
        out[f"q_lora_rank {q_lora_rank}, sp {sp}"] = case
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
# Skip interpreter finalization, where gloo's threads can abort a finished rank (see exit_process).
exit_process(0)
"""


def test_every_gradient_under_tp2_is_one_process_gradient(tmp_path):
    out = run_ranks_script(SCRIPT, 2, tmp_path)
    # A gradient sums the chain of the forward and backward sums and then over the 32 tokens.
    terms = 2 * transformer_sums(n_layers=1, dim=32, hidden=48, seq=16, head_dim=12) + 32
    for case, grads in out.items():
        assert "layers.0.attention.wkv_a.weight" in grads, case
        for name, g in grads.items():
            assert g["spread"] == 0.0, f"{case}: {name}'s replicated gradient differs across tp ranks by {g['spread']}"
            bound = largest_difference(torch.float32, terms, g["scale"])
            assert g["err"] <= bound, f"{case}: {name}'s gradient is {g['err']} from one process's (bound {bound})"

