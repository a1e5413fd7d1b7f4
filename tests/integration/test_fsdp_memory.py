"""FSDP shards what each rank holds: per-rank parameter + optimizer-state bytes under FSDP N are
about 1/N of the single-process total (DDP keeps a full copy on every rank).

The counts come from the line every rank logs after its first step; the runs are the parity
harness's, so this test adds no training runs of its own.
"""

import re

import torch

from torchtitan.models import get_train_spec
from torchtitan.tools.parity import all_layouts

_LINE = re.compile(r"rank (\d+) holds parameters ([\d.]+) MiB, optimizer state ([\d.]+) MiB")


def state_bytes_per_rank(stdout: str) -> dict[int, float]:
    return {int(r): (float(p) + float(o)) * 2**20 for r, p, o in _LINE.findall(stdout)}


def one_block_bytes() -> float:
    """A transformer block's parameters and their two AdamW moments, in fp32."""
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls.from_model_args(spec.config["debugmodel"])
    return 3 * 4 * sum(p.numel() for p in model.layers["0"].parameters())


def test_fsdp_holds_one_nth_of_the_state_per_rank(parity):
    (total,) = state_bytes_per_rank(parity.baseline().stdout).values()
    block = one_block_bytes()
    assert total > 8 * block  # the debug model has 8 blocks plus embedding and output
    for name, n in (("fsdp2", 2), ("fsdp4", 4), ("hsdp2x2", 2)):
        per_rank = state_bytes_per_rank(parity.run(all_layouts()[name]).stdout)
        assert sorted(per_rank) == list(range(all_layouts()[name].nproc)), per_rank
        for rank, held in per_rank.items():
            print(f"{name} rank {rank}: {held / 2**20:.2f} MiB of {total / 2**20:.2f} MiB (1/{n} = {total / n / 2**20:.2f})")
            assert abs(held - total / n) <= 0.1 * total / n + block, (name, rank, held, total)


def test_ddp_holds_a_full_copy_per_rank(parity):
    (total,) = state_bytes_per_rank(parity.baseline().stdout).values()
    per_rank = state_bytes_per_rank(parity.run(all_layouts()["ddp2"]).stdout)
    assert len(per_rank) == 2 and all(held == total for held in per_rank.values()), (per_rank, total)
