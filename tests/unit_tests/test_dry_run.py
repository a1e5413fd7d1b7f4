"""The dry run in this process (PyTorch's fake process group and fake tensors): what it builds and
counts for a rank of a larger world, the pipeline replay's reading of a schedule, its refusals.
That its estimates equal what real ranks measure is tests/integration/test_memory_estimate.py."""

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.errors import ConfigError, UserError
from torchtitan.estimation.dry_run import DoesNotFit, DryRunResult, dry_run, main, ranks_to_simulate, report_lines
from torchtitan.estimation.pipeline_replay import _compute_actions
from torchtitan.estimation.tracker import CATEGORIES
from torchtitan.models import get_train_spec, register_train_spec, registered_names

# The tiny flavor: what the dry run does per block does not need the debug model's 8 blocks.
DEBUG = ["--job.config_file", "bundled:train_configs/debug_model.toml", "--model.flavor", "tiny", "--training.seq_len", "128",
         "--job.dry_run", "--job.dry_run_device", "cpu"]


def estimate(*args: str, world: int):
    return dry_run(parse_args([*DEBUG, "--job.dry_run_world_size", str(world), *args]))


def test_a_rank_of_eight_holds_an_eighth_of_the_state():
    """FSDP over 8 ranks: the sharded fp32 parameters and Adam's two moments are those of 1/8 of
    the model (to FSDP's padding), counted by PyTorch's tracker on fake tensors."""
    one = estimate(world=1).ranks[0].memory.raw
    eight = estimate(world=8)
    rank = eight.ranks[0]
    assert [r.rank for r in eight.ranks] == [0] and rank.coordinates == {"dp_shard": 0}
    params = one["Parameter"]  # one process: plain parameters, fp32
    assert rank.memory.raw["Sharded Param"] == pytest.approx(params / 8, rel=0.01)
    assert rank.memory.raw["OptState"] == pytest.approx(2 * params / 8, rel=0.01)
    assert set(rank.memory.at_peak) == set(CATEGORIES) and rank.memory.peak == sum(rank.memory.at_peak.values())


def test_pipeline_ranks_simulated_are_the_first_and_the_last():
    """One process simulates both; the second builds meshes equal to the first's over new process
    groups (with TP, DTensor's cached sharding decisions would name the first's, destroyed)."""
    result = estimate("--experimental.pipeline_parallel_degree", "2", "--training.data_parallel_shard_degree", "2",
                      "--training.tensor_parallel_degree", "2", world=8)
    assert [(r.rank, r.stages) for r in result.ranks] == [(0, (0,)), (4, (1,))]
    assert all(r.memory.peak > 0 for r in result.ranks)
    dims = types.SimpleNamespace(world_size=8, pp=4)
    assert ranks_to_simulate(dims, -1) == [0, 6] and ranks_to_simulate(dims, 3) == [3]
    with pytest.raises(ConfigError, match="job.dry_run_rank 8 is no rank of a world of 8"):
        ranks_to_simulate(dims, 8)


def _action(text: str):
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(text)


def test_the_replay_numbers_microbatches_by_occurrence():
    """PyTorch 2.13's 1F1B order numbers the last stage's microbatches from 1 (1F1, 1B0, 1F2, 1B1);
    the replay keeps what the order says about memory (one microbatch in flight) and renumbers."""
    order = [_action(a) for a in ("1F1", "1B0", "1F2", "1B1", "1REDUCE_GRAD")]
    assert _compute_actions(order) == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]
    zero_bubble = [_action(a) for a in ("0F0", "0I0", "0W0")] + [None]
    assert _compute_actions(zero_bubble) == [("F", 0, 0), ("W", 0, 0)]  # I is run with its W


def test_a_rank_that_would_not_fit_is_one_line(capsys):
    with pytest.raises(DoesNotFit) as raised:
        main(parse_args([*DEBUG, "--job.dry_run_world_size", "2", "--memory_estimation.device_memory_gib", "0.01"]))
    assert str(raised.value).startswith("rank 0 would need ") and "more than the device's 0.01 GiB (memory_estimation.device_memory_gib)" in str(raised.value)


def test_mistakes_the_real_job_would_make_are_its_lines():
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        estimate("--training.tensor_parallel_degree", "2", world=3)
    with pytest.raises(ConfigError, match="job.dry_run_world_size must be a number of ranks"):
        parse_args([*DEBUG, "--job.dry_run_world_size", "-1"])
    with pytest.raises(UserError, match="unknown training.dataset 'nope'"):
        estimate("--training.dataset", "nope", world=2)


def test_a_pipelining_fn_that_describes_no_stages_is_refused_not_guessed():
    """A family whose pipelining_fn leaves out what the replay needs (here: the stage ids): the
    line names the model and what to change, and the fake process group is gone afterwards."""
    if "llama3_no_replay" not in registered_names():
        llama3 = get_train_spec("llama3")

        def no_stage_ids(model, **kwargs):
            return dataclasses.replace(llama3.pipelining_fn(model, **kwargs), stage_ids=())

        register_train_spec(dataclasses.replace(llama3, name="llama3_no_replay", pipelining_fn=no_stage_ids))
    with pytest.raises(ConfigError) as e:
        estimate("--model.name", "llama3_no_replay", "--experimental.pipeline_parallel_degree", "2", world=2)
    assert str(e.value) == ("model llama3_no_replay's pipelining_fn gives no stage description the dry run can replay "
                            "(Pipeline.stage_ids, microbatch_loss, first_stage); dry-run it without "
                            "experimental.pipeline_parallel_degree")
    assert not dist.is_initialized()


def test_measuring_real_ranks_needs_the_world_the_launcher_started(monkeypatch):
    """memory_estimation.disable_fake_mode measures the ranks torchrun started: a different
    job.dry_run_world_size is refused before any process group."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as e:
        main(parse_args([*DEBUG, "--memory_estimation.disable_fake_mode", "--job.dry_run_world_size", "2"]))
    assert str(e.value) == ("job.dry_run_world_size 2 is not this job's 1 ranks: memory_estimation.disable_fake_mode "
                            "measures the ranks the launcher started (set NGPU)")
    assert not dist.is_initialized()


def test_a_tokenizer_only_the_cluster_has_stands_in_with_the_flavors_vocabulary():
    result = estimate("--model.tokenizer_path", "no/such/tokenizer.model", "--training.batch_size", "1", world=2)
    assert any("tokenizer file not found: no/such/tokenizer.model" in n and "128,256 tokens" in n for n in result.notes)
    sized = estimate("--job.dry_run_vocab_size", "128256", "--training.batch_size", "1", world=2)
    assert sized.ranks[0].memory.peak == result.ranks[0].memory.peak


def test_a_gpu_job_is_simulated_in_its_compute_dtype():
    """Standing for CUDA, FSDP computes in bf16 (`auto`) and the attention kernel runs in it: the
    activations are smaller than those of the CPU's fp32."""
    cpu = estimate(world=2).ranks[0].memory.at_peak["activations"]
    cuda = dry_run(parse_args([*DEBUG, "--job.dry_run_world_size", "2", "--job.dry_run_device", "cuda"]))
    assert cuda.compute_dtype == "bfloat16" and cuda.ranks[0].memory.at_peak["activations"] < 0.7 * cpu


def test_balanced_routing_stands_for_moe_on_fake_tensors():
    args = ["--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml", "--model.flavor", "tiny_moe", "--training.seq_len", "128",
            "--job.dry_run", "--job.dry_run_device", "cpu", "--training.expert_parallel_degree", "2"]
    result = dry_run(parse_args([*args, "--job.dry_run_world_size", "2"]))
    assert result.ranks[0].memory.peak > 0 and result.ranks[0].parallelisms["moe"] is not None


def test_the_process_group_and_patches_are_gone_afterwards():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    estimate(world=2)
    assert not torch.distributed.is_initialized()
    assert torch.nn.init.trunc_normal_.__module__ == "torch.nn.init"
    assert _fsdp_param._chunk_with_empty.__module__.startswith("torch.")
    assert DeviceMesh.__init__.__module__.startswith("torch.")
    assert DeviceMesh._init_one_process_group.__module__.startswith("torch.")


def test_ddp_options_that_mean_something_across_replicas_are_accounted_for():
    """Plain DDP runs as one replica; ZeRO-1 and a bf16 gradient reduction (checked against the
    replicas) are not refused for it: ZeRO-1 keeps 1/replicas of the optimizer state."""
    ddp = ["--training.data_parallel_replicate_degree", "4", "--training.data_parallel_shard_degree", "1",
           "--training.batch_size", "1"]
    plain = estimate(*ddp, world=4).ranks[0].memory
    zero1 = estimate(*ddp, "--optimizer.zero1", "--training.mixed_precision_reduce", "bfloat16", world=4).ranks[0].memory
    assert zero1.at_peak["optimizer"] == pytest.approx(plain.at_peak["optimizer"] / 4, rel=0.01)
    assert zero1.peak < plain.peak


def test_a_cpu_job_is_judged_as_the_cpu_runs_it():
    """Standing for this CPU, what the CPU refuses is refused (float8 without emulation), the
    tokenizer must be here, and a layout without FSDP computes in bf16 (autocast) when standing for CUDA."""
    with pytest.raises(UserError, match="float8.enable_float8_linear needs CUDA"):
        estimate("--float8.enable_float8_linear", world=2)
    with pytest.raises(UserError, match="no/such/tokenizer.model"):
        dry_run(parse_args([*DEBUG, "--model.tokenizer_path", "no/such/tokenizer.model"]))
    tp = dry_run(parse_args([*DEBUG, "--job.dry_run_world_size", "2", "--job.dry_run_device", "cuda",
                             "--training.tensor_parallel_degree", "2", "--training.batch_size", "1"]))
    assert tp.compute_dtype == "bfloat16"


def test_dry_run_options_need_the_dry_run():
    base = ["--job.config_file", "bundled:train_configs/debug_model.toml"]
    for option in (["--job.dry_run_world_size", "64"], ["--memory_estimation.disable_fake_mode"]):
        with pytest.raises(ConfigError, match=f"{option[0].removeprefix('--')} needs job.dry_run"):
            parse_args([*base, *option])


def test_fsdp_accumulation_keeps_gradients_sharded_unless_deferred():
    """FSDP 8 with 4 micro-steps: by default each micro-step's gradients are reduce-scattered into
    the shards, so no unsharded copy outlives a micro-step; deferring the reduction keeps one of
    the whole model (fp32 here) across them. The dry run simulates 2 of the 4 micro-steps (the
    first and the last) and says so."""
    accum = ["--training.gradient_accumulation_steps", "4"]
    default = estimate(*accum, world=8)
    deferred = estimate(*accum, "--training.defer_sharded_gradient_reduction", world=8)
    params = estimate(world=1).ranks[0].memory.raw["Parameter"]
    extra = deferred.ranks[0].memory.peak - default.ranks[0].memory.peak
    assert 0.8 * params < extra < 1.2 * params
    assert any("2 of the step's 4 micro-steps are simulated" in note for note in default.notes)


def test_document_masking_is_simulated_on_both_targets():
    """training.document_mask runs through the dry run's step (the pipeline replay hands every
    stage the document ids): standing for the CPU, its (batch, 1, seq, seq) fp32 mask is counted;
    standing for CUDA, FlexAttention is counted as causal attention (its block mask is tiny), with a note."""
    pp = ["--experimental.pipeline_parallel_degree", "2", "--job.dry_run_rank", "0"]
    mask_bytes = 8 * 128 * 128 * 4  # training.batch_size x seq_len x seq_len, fp32
    plain, masked = (estimate(*pp, *extra, world=2).ranks[0].memory.peak for extra in ([], ["--training.document_mask"]))
    assert mask_bytes <= masked - plain <= 4 * mask_bytes, (masked - plain) / mask_bytes
    cuda = ["--job.dry_run_world_size", "2", "--job.dry_run_device", "cuda"]
    plain, masked = (dry_run(parse_args([*DEBUG, *cuda, *extra])) for extra in ([], ["--training.document_mask"]))
    assert masked.ranks[0].memory.peak - plain.ranks[0].memory.peak == 8 * 128 * 4  # the int32 document ids alone
    assert any("document masking is simulated as causal attention" in note for note in masked.notes)


def test_document_masking_under_cp_is_simulated_as_causal():
    """Under CP the blocks' plan reads the document ids' values, which fake tensors lack: the dry
    run plans plain causal attention (an upper bound), with a note."""
    cp = ["--experimental.context_parallel_degree", "2", "--job.dry_run_world_size", "2", "--job.dry_run_device", "cpu"]
    plain, masked = (dry_run(parse_args([*DEBUG, *cp, *extra])) for extra in ([], ["--training.document_mask"]))
    assert masked.ranks[0].memory.peak - plain.ranks[0].memory.peak == 8 * 128 * 4  # the int32 document ids alone
    assert any("document masking under context parallelism is simulated" in note for note in masked.notes)


MOE = ["--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml", "--model.flavor", "tiny_moe",
       "--training.seq_len", "128", "--job.dry_run", "--job.dry_run_device", "cuda", "--training.expert_parallel_degree", "4",
       "--job.dry_run_world_size", "8", "--experimental.pipeline_parallel_degree", "2"]


def test_an_moe_rank_under_ep_and_pp_reports_the_experts_share():
    """EP 4 x PP 2 of 8 ranks: the first and the last pipeline rank, each with its experts'
    parameters and optimizer state (a quarter of each layer's experts, FSDP-sharded over none
    else: 2 x 4 ranks hold the stage) and one MoE layer's dispatch buffers."""
    result = dry_run(parse_args(MOE))
    assert [r.rank for r in result.ranks] == [0, 4] and [r.stages for r in result.ranks] == [(0,), (1,)]
    tiny = get_train_spec("qwen3").config["tiny_moe"]
    one_layer = 3 * tiny.num_experts * tiny.dim * tiny.moe_hidden_dim * 4  # fp32, each stage holds one MoE layer
    for r in result.ranks:
        experts = r.memory.experts
        assert experts["expert parameters"] == one_layer // 4
        assert experts["expert optimizer"] == pytest.approx(2 * one_layer // 4, abs=64)  # two moments, step counts
        assert 0 < experts["dispatch buffers"] < r.memory.peak
    lines = report_lines(result, "x")
    assert sum("experts: parameters" in line for line in lines) == 2


def test_dropless_imbalance_grows_the_busiest_ranks_buffers():
    """expert_load: the simulated rank receives that many times its even share under EP."""
    ep4 = [*MOE[:-4], "--job.dry_run_world_size", "4"]
    even, busy = (dry_run(parse_args(ep4), expert_load=load).ranks[0].memory for load in (1.0, 2.0))
    assert busy.experts["dispatch buffers"] > 1.3 * even.experts["dispatch buffers"]
    assert busy.peak > even.peak and busy.experts["expert parameters"] == even.experts["expert parameters"]


def test_the_dropping_mode_has_the_same_buffers_whatever_the_load():
    """moe.capacity_factor: the buffers are padded to the capacity (fixed shapes), so the busiest
    rank's load, a dropless notion, changes nothing; the dry run runs the mode's own code."""
    capped = [*MOE[:-4], "--job.dry_run_world_size", "4", "--moe.capacity_factor", "1.25"]
    even, busy = (dry_run(parse_args(capped), expert_load=load).ranks[0].memory for load in (1.0, 2.0))
    assert 0 < even.experts["dispatch buffers"] == busy.experts["dispatch buffers"] and even.peak == busy.peak


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 9, 100])
def test_fsdp_chunks_made_on_demand_are_fsdps_own(rows):
    """own_share_only's chunks: the same shapes and views as FSDP's `_chunk_with_empty` (torch.chunk
    padded with empty tensors), for tensors with fewer rows than chunks too."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from torchtitan.runtime.torch_compat.fake import _LazyChunks

    for shape, dim in (((rows, 3), 0), ((2, rows), 1)):
        tensor = torch.empty(shape)
        for n in (1, 2, 3, 8, 1000):
            lazy, eager = _LazyChunks(tensor, n, dim), _chunk_with_empty(tensor, n, dim)
            assert len(lazy) == len(eager) == n and lazy[-1].shape == eager[-1].shape
            assert [(c.shape, c.storage_offset()) for c in lazy] == [(c.shape, c.storage_offset()) for c in eager]


def test_a_torch_without_the_names_builds_every_rank_as_before(monkeypatch):
    """own_share_only changes nothing where a torch build lacks a private name it relies on (the
    dry run is then slower at large worlds, not wrong)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from torchtitan.runtime.torch_compat.fake import own_share_only

    monkeypatch.delattr(_fsdp_param, "_chunk_with_empty")
    init = DeviceMesh.__init__
    with own_share_only():
        assert DeviceMesh.__init__ is init and not hasattr(_fsdp_param, "_chunk_with_empty")


def _groups_made(monkeypatch, *args: str, world: int):
    """The process groups a dry run of `world` ranks creates (each torch.distributed.new_group)."""
    from torch.distributed import distributed_c10d

    made = []
    original = distributed_c10d._new_group_with_tag
    monkeypatch.setattr(distributed_c10d, "_new_group_with_tag", lambda *a, **k: made.append(1) or original(*a, **k))
    result = estimate(*args, world=world)
    monkeypatch.setattr(distributed_c10d, "_new_group_with_tag", original)
    return len(made), result


def test_ranks_that_are_alike_cost_nothing(monkeypatch):
    """A rank of 2^16 (HSDP: 2 replicas of 2^15 shards) is built from its own share: the mesh makes
    its own process groups only, as many as for 8 ranks, and FSDP cuts each parameter for it alone
    (without own_share_only: 2^15 groups for the replicas' dim and 2^15 chunks per parameter, which
    grows to hours at a million ranks). Its shard is the first row of each parameter."""
    hsdp = ["--training.data_parallel_replicate_degree", "2", "--training.batch_size", "1"]
    small, _ = _groups_made(monkeypatch, *hsdp, world=8)
    large, result = _groups_made(monkeypatch, *hsdp, world=2**16)
    assert large == small and result.ranks[0].coordinates == {"dp_replicate": 0, "dp_shard": 0}
    config = parse_args([*DEBUG, "--job.dry_run_world_size", str(2**16), *hsdp])
    model = preflight(config, 2**16, "cpu", check_memory=False).model  # on the meta device
    assert max(p.shape[0] for p in model.parameters()) < 2**15  # so each rank holds one row or none
    assert result.ranks[0].memory.raw["Sharded Param"] == sum(4 * p[0].numel() for p in model.parameters())


def test_the_verdict_names_what_it_compares_with(monkeypatch):
    """memory_estimation.device_memory_gib 0: a job on this CPU is judged against the host's
    available memory shared by its ranks, and the verdict says so; a GPU job planned on a machine
    without a GPU gets no verdict, and the line says why and what to set."""
    from torchtitan.estimation.device_memory import LOCAL_WORLD_SIZE_ENV, device_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("LOCAL_WORLD_SIZE", LOCAL_WORLD_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)
    config = parse_args(DEBUG)
    cpu, cuda = device_memory(config, "cpu", 2), device_memory(config, "cuda", 2)
    assert cpu.bytes > 0 and cpu.source == ("this host's available memory shared by its 2 ranks: the job runs on this "
                                            "CPU")
    assert cuda.bytes is None and cuda.source == "no GPU here to compare with: set memory_estimation.device_memory_gib"
    given = device_memory(parse_args([*DEBUG, "--memory_estimation.device_memory_gib", "80"]), "cuda", 2)
    assert (given.bytes, given.source) == (80 * 2**30, "memory_estimation.device_memory_gib")
    rank = estimate(world=2).ranks[0]
    verdicts = [report_lines(DryRunResult(2, "cpu", "float32", [], [rank], m.bytes, m.source), "layout")[-1]
                for m in (cpu, cuda)]
    assert verdicts[0].endswith(f"GiB per device ({cpu.source}): fits")
    assert verdicts[1].endswith(f"GiB at its peak; no verdict ({cuda.source})")
