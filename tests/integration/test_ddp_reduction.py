"""DDP over 4 gloo ranks reduces the first step of a process bitwise as it reduces every later step
(parallelisms/ddp_reduction.py): PyTorch's DDP changes its bucket layout after the first backward,
and over more than two ranks the sums depend on it, so a run resumed from a checkpoint used to
leave the uninterrupted run's losses in the last bits."""

import os
import subprocess
import sys

import torch

from tests.helpers import REPO_ROOT
from tests.tolerances import reordered_sums

# One process imports torch, then forks the 4 ranks (cheaper than torchrun's 5 imports).
SCRIPT = r"""
import os, socket, sys, traceback
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.parallelisms.data_parallel import apply_ddp
from torchtitan.runtime.process_group import exit_process

class Tower(nn.Module):
    # 0.39 M parameters (1.6 MB): DDP rebuilds them into two 1 MB buckets, in backward's order.
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(500, 128)
        self.up, self.down = nn.Linear(128, 1024), nn.Linear(1024, 128)
        self.output = nn.Linear(128, 500, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.output(h + self.down(torch.tanh(self.up(h))))

def rank_main(rank):
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_replicate",))
    torch.manual_seed(0)
    model = Tower()
    apply_ddp(model, mesh, bucket_cap_mb=1, reduce_dtype=torch.float32, compiled=False)
    gen = torch.Generator().manual_seed(rank)
    micro_batches = [torch.randint(0, 500, (2, 16), generator=gen) for _ in range(2)]

    def step(sync):
        # Two micro-batches, reduced (when `sync`) on the last one, as gradient accumulation does.
        for i, tokens in enumerate(micro_batches):
            model.set_requires_gradient_sync(sync and i == len(micro_batches) - 1)
            model(tokens).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    first, second, local = step(True), step(True), step(False)
    torch.save({"first": first, "second": second, "local": local}, f"{sys.argv[1]}/rank{rank}.pt")
    dist.destroy_process_group()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
ranks = []
for rank in range(4):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rank_main(rank)
            code = 0
        except BaseException:
            traceback.print_exc()
        exit_process(code)
    ranks.append(pid)
sys.exit(int(any(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in ranks)))
"""


def test_the_first_step_is_reduced_bitwise_as_the_later_ones(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for i in range(len(ranks[0]["first"])):
        first = [r["first"][i] for r in ranks]
        assert all(torch.equal(g, r["second"][i]) for g, r in zip(first, ranks)), f"parameter {i}: steps 1 and 2 differ"
        # Reduced: every rank holds the same gradient, the mean of the ranks' own.
        assert all(torch.equal(g, first[0]) for g in first), f"parameter {i} differs across ranks"
        local = torch.stack([r["local"][i] for r in ranks])
        mean = local.double().mean(0).float()
        torch.testing.assert_close(first[0], mean, **reordered_sums(torch.float32, 4, local.abs().max().item()))
