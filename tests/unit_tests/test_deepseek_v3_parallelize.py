"""What parallelize_deepseek_v3 makes of the multi-token prediction module, read from the modules it
leaves (rank 0 of 4 on PyTorch's "fake" process-group backend, the model on the meta device, nothing
trained): under FSDP 2 x CP 2 with EP 2, the MTP module is an FSDP unit of its own beside the
blocks, its MoE layer's experts one of their own over the experts' mesh (as the main blocks'), its
block checkpointed by each activation-checkpointing mode as the main blocks are (the selective
interval counting it by its layer id), compiled where they compile, and its attention context
parallel. That it trains like one process is the parity rows' and the layout matrix's proof."""

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from tests.helpers import TINY_RUN
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.parallelisms.context_parallel import labels_ahead_over_cp
from torchtitan.runtime.torch_compat.composable import CheckpointWrapper, bare_name
from torchtitan.runtime.torch_compat.fake import fake_store

LAYOUT = ("--training.data_parallel_shard_degree", "2", "--experimental.context_parallel_degree", "2",
          "--training.expert_parallel_degree", "2")


@pytest.fixture
def fake_world():
    """Rank 0 of 4 on the "fake" backend (collectives do nothing, no peers run), for the test's length."""
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def parallelized(*args: str):
    """Rank 0's DeepSeek-V3 tiny (2 blocks, layer ids 0 and 1; the MTP block's is 2) under LAYOUT."""
    config = parse_args([*TINY_RUN, "--model.name", "deepseek_v3", "--model.flavor", "tiny", *LAYOUT, *args])
    job = preflight(config, world_size=4, device_type="cpu", check_memory=False)
    job.parallel_dims.build_mesh("cpu")
    return job.train_spec.parallelize_fn(job.model, job.parallel_dims, config), job.parallel_dims


@pytest.mark.parametrize("mode,option,wrapped", [
    ("none", "", set()),
    ("full", "", {"layers.0", "layers.1", "mtp.0.block"}),
    ("selective", "2", {"layers.0", "mtp.0.block"}),  # ids 0 and 2
    ("selective", "3", {"layers.0"}),  # id 2 is no multiple of 3
])
def test_the_mtp_module_is_an_fsdp_unit_and_its_block_checkpointed_like_the_blocks(fake_world, mode, option, wrapped):
    model, dims = parallelized("--activation_checkpoint.mode", mode,
                               *(("--activation_checkpoint.selective_ac_option", option) if option else ()))
    mtp = model.mtp[0]
    assert {name for name, m in model.named_modules() if isinstance(m, CheckpointWrapper)} == wrapped
    units = {bare_name(name) for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    # The blocks, the MTP module and the root, each over the FSDP mesh; every MoE layer's experts
    # (the MTP block's too) over the experts' own mesh, inside their unit.
    assert units == {"", "layers.0", "layers.1", "mtp.0", "layers.1.moe.experts", "mtp.0.block.moe.experts"}
    assert mtp.eh_proj.weight.device_mesh.mesh_dim_names == dims.fsdp_mesh.mesh_dim_names
    assert mtp.block.moe.experts.w1.device_mesh.mesh_dim_names == ("efsdp", "ep")
    # Context parallelism reaches the MTP block's attention as the blocks' (ring kernel, padded values).
    for block in (model.layers["0"], mtp.block):
        assert block.attention.kernel.keywords["method"] == "ring" and block.attention.pad_values
    assert model.labels_ahead.__qualname__ == labels_ahead_over_cp(dims.cp_mesh).__qualname__
    assert model.loss_ranks == 4  # dp_shard x cp: the ranks whose losses are averaged


def test_op_level_checkpointing_and_compile_reach_the_mtp_block(fake_world):
    model, _ = parallelized("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                            "op", "--training.compile", "--training.expert_parallel_degree", "1")
    for block in (model.layers["0"], model.layers["1"], model.mtp[0].block):
        assert isinstance(block, CheckpointWrapper) and "context_fn" in block.checkpoint_fn.keywords
        assert block._compiled_call_impl is not None  # the checkpointed block compiles whole (no EP, no TP)
