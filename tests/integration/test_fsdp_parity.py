"""Single process vs 2-rank FSDP: same seed checkpoint and global batch give the same losses."""

from tests.helpers import TINY_RUN, losses, read_metrics, run_train

TOLERANCE = 1e-4


def test_fsdp2_matches_single_process(tmp_path):
    seed = tmp_path / "seed"
    run_train([*TINY_RUN, "--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint"])
    # Global batch 8 in both runs; dataset_shards=2 gives the baseline the same rows the two
    # ranks read together.
    common = [*TINY_RUN, "--training.dataset_shards", "2", "--training.deterministic",
              "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    run_train([*common, "--job.dump_folder", str(tmp_path / "base"), "--training.batch_size", "8"])
    run_train([*common, "--job.dump_folder", str(tmp_path / "fsdp"), "--training.batch_size", "4",
               "--training.data_parallel_shard_degree", "2"], nproc=2)

    base, fsdp = losses(tmp_path / "base"), losses(tmp_path / "fsdp")
    assert len(base) == len(fsdp) == 10
    diffs = [abs(a - b) for a, b in zip(base, fsdp)]
    print(f"max |loss diff| single vs FSDP 2 over 10 steps: {max(diffs):.3e}")
    assert max(diffs) <= TOLERANCE, list(zip(base, fsdp))
    assert base[-1] < base[0], "loss should fall over 10 steps"
    grad_norms = [r["grad_norm"] for r in read_metrics(tmp_path / "base")], [r["grad_norm"] for r in read_metrics(tmp_path / "fsdp")]
    assert abs(grad_norms[0][-1] - grad_norms[1][-1]) <= 1e-3 * grad_norms[0][-1]

