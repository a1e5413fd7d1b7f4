"""A checkpoint written under one parallel layout continues under another with the losses of a
run that never changed layout (within 1e-4), the data position included: FSDP 4 -> TP 2 x FSDP 2
-> PP 2 x FSDP 2, TP 2 x FSDP 2 -> one process, PP 2 -> FSDP 2, and FSDP 4 -> ZeRO-1 HSDP 2 x 2 -> ZeRO-1 DDP 4.
Every run keeps the global batch (8 rows; training.batch_size is per data-parallel rank);
the data-parallel degree changes from 4 to 2 to 1, and the resumed runs read the data in the
checkpoint's 4 shards (training.dataset_shards stays at its default, -1)."""

import json
import shutil

import pytest

from tests.helpers import TINY_RUN, read_metrics, read_setup, run_train
from torchtitan.tools.parity import LOSS_TOLERANCE as TOLERANCE  # fp32 sums in another order (its reasoning there)

STEPS = 6
LAYOUTS = {  # name: (processes, per-rank batch, overrides)
    "fsdp4": (4, 2, ["--training.data_parallel_shard_degree", "4"]),
    "tp2_fsdp2": (4, 4, ["--training.data_parallel_shard_degree", "2", "--training.tensor_parallel_degree", "2"]),
    "pp2_fsdp2": (4, 4, ["--training.data_parallel_shard_degree", "2", "--experimental.pipeline_parallel_degree", "2"]),
    "pp2": (2, 8, ["--experimental.pipeline_parallel_degree", "2"]),
    "fsdp2": (2, 4, ["--training.data_parallel_shard_degree", "2"]),
    "single": (1, 8, []),
    "tp2": (2, 8, ["--training.tensor_parallel_degree", "2"]),
    # ZeRO-1: optimizer state split over the replicas (2 and then 4 owners per parameter set).
    "zero1_hsdp2x2": (4, 2, ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree",
                             "2", "--optimizer.zero1"]),
    "zero1_ddp4": (4, 2, ["--training.data_parallel_replicate_degree", "4", "--training.data_parallel_shard_degree",
                          "1", "--optimizer.zero1"]),
}


def run(folder, layout, extra=()):
    nproc, batch, overrides = LAYOUTS[layout]
    args = [*TINY_RUN, "--training.steps", str(STEPS), "--training.deterministic", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", "2", "--training.batch_size", str(batch), "--job.dump_folder", str(folder),
            *overrides, *extra]
    return run_train(args, nproc=nproc, timeout=400)


def resume(tmp_path, name, layout, source, step, extra=()):
    """Starts `layout` in a new job folder that holds only `source`'s step-`step` checkpoint."""
    folder = tmp_path / name
    shutil.copytree(source / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    run(folder, layout, extra)
    setup = read_setup(folder)
    assert setup["initial_load"]["step"] == step and not setup["initial_load"]["weights_only"]
    return folder, setup


def losses(folder):
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """FSDP 4 for all 6 steps, a checkpoint every 2."""
    folder = tmp_path_factory.mktemp("reshard") / "fsdp4"
    run(folder, "fsdp4")
    return folder


def assert_continues(reference, folder, first_step):
    expected, got = losses(reference), losses(folder)
    assert sorted(got) == list(range(first_step, STEPS + 1))
    diffs = [abs(got[s] - expected[s]) for s in got]
    print(f"{folder.name} from step {first_step}: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) <= TOLERANCE, list(zip(got.values(), (expected[s] for s in got)))


def test_fsdp4_to_tp2_fsdp2_to_pp2_fsdp2_and_to_one_process(reference, tmp_path):
    tp_fsdp, setup = resume(tmp_path, "tp2_fsdp2", "tp2_fsdp2", reference, 2)
    assert setup["data_shards"] == 4 and setup["mesh"] == {"dp_shard": 2, "tp": 2}  # 2 shards per data-parallel rank
    assert_continues(reference, tp_fsdp, 3)

    pp_fsdp, _ = resume(tmp_path, "pp2_fsdp2", "pp2_fsdp2", tp_fsdp, 4)
    assert_continues(reference, pp_fsdp, 5)

    single, setup = resume(tmp_path, "single", "single", tp_fsdp, 4)
    assert setup["data_shards"] == 4 and setup["world_size"] == 1
    assert_continues(reference, single, 5)


def test_zero1_checkpoints_hold_every_replicas_share_and_load_under_other_owners(reference, tmp_path):
    """Each ZeRO-1 replica saves only the optimizer state it owns, by parameter name; FSDP 4's
    checkpoint loads into HSDP 2 x 2 with ZeRO-1 (each replica takes its owned half), whose
    checkpoint then loads into DDP 4 with ZeRO-1 (other owners, no sharding), losses unchanged."""
    hsdp, setup = resume(tmp_path, "zero1_hsdp2x2", "zero1_hsdp2x2", reference, 2)
    assert setup["zero1"]["replicas"] == 2
    assert_continues(reference, hsdp, 3)
    ddp, setup = resume(tmp_path, "zero1_ddp4", "zero1_ddp4", hsdp, 4)
    assert setup["zero1"]["replicas"] == 4
    assert_continues(reference, ddp, 5)


@pytest.mark.fast
def test_tied_embeddings_saved_by_two_pipeline_stages_load_into_one_weight(tmp_path):
    """Under PP the first stage saves the tied matrix as tok_embeddings.weight and the last as
    output.weight; one process loads both names into its single weight and continues with the
    pipeline run's losses."""
    tied = ["--model.flavor", "tiny_tied"]
    pipeline = tmp_path / "tied_pp2"
    run(pipeline, "pp2", tied)
    single, _ = resume(tmp_path, "tied_single", "single", pipeline, 4, tied)
    assert_continues(pipeline, single, 5)


def test_pipeline_checkpoint_continues_on_two_data_parallel_ranks_with_half_the_per_rank_batch(tmp_path):
    """PP 2 reads both data shards on its one data-parallel rank, 8 rows a step; FSDP 2 reads
    one shard per rank, so 4 rows each keep the global batch, and the checkpoint records it."""
    shards = ["--training.dataset_shards", "2"]
    pipeline = tmp_path / "pp2_shards2"
    run(pipeline, "pp2", shards)
    manifest = json.loads((pipeline / "checkpoint" / "step-4" / "manifest.json").read_text())
    assert manifest["global_batch"] == {"sequences": 8, "seq_len": int(TINY_RUN[TINY_RUN.index("--training.seq_len") + 1])}
    fsdp, setup = resume(tmp_path, "fsdp2_shards2", "fsdp2", pipeline, 4, shards)
    assert setup["data_shards"] == 2 and setup["mesh"] == {"dp_shard": 2}
    assert_continues(pipeline, fsdp, 5)


def test_deepseek_mtp_embedding_copy_saved_by_the_last_stage_loads_into_one_weight(tmp_path):
    """DeepSeek-V3 with multi-token prediction under PP: the last stage keeps a copy of the token
    embedding (for MTP) under the first stage's name, `tok_embeddings.weight`, one weight with it;
    both stages save it, and one process loads it (with the experts, their bias and MTP's
    modules) and continues with the pipeline run's losses."""
    model = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--moe.bias_update_rate", "0.001"]
    pipeline = tmp_path / "dsv3_pp2"
    run(pipeline, "pp2", model)
    single, _ = resume(tmp_path, "dsv3_single", "single", pipeline, 4, model)
    assert_continues(pipeline, single, 5)


@pytest.mark.budget("four short runs: the FSDP reference, two layouts resumed from it, and one refusal")
def test_muon_state_saved_under_fsdp_continues_under_tp_and_one_process_and_refuses_adamw(tmp_path):
    """optimizer.name Muon: each matrix's momentum (and AdamW's moments of the rest) is saved by
    parameter name from FSDP 2's row shards and loads into TP 2 (other shards) and into one process,
    whose losses continue the FSDP run's. The same checkpoint under AdamW is refused with one line."""
    muon = ["--optimizer.name", "Muon"]
    fsdp = tmp_path / "muon_fsdp2"
    run(fsdp, "fsdp2", muon)
    for layout in ("tp2", "single"):
        folder, _ = resume(tmp_path, f"muon_{layout}", layout, fsdp, 4, muon)
        assert_continues(fsdp, folder, 5)
    folder = tmp_path / "adamw_from_muon"
    shutil.copytree(fsdp / "checkpoint" / "step-4", folder / "checkpoint" / "step-4")
    result = run_train([*TINY_RUN, "--job.dump_folder", str(folder), "--training.steps", str(STEPS),
                        "--checkpoint.enable_checkpoint"], check=False)
    assert result.returncode == 2
    assert ("its optimizer state is another optimizer's: the checkpoint has no optimizer.state.layers.0"
            in result.stdout + result.stderr), result.stdout + result.stderr
