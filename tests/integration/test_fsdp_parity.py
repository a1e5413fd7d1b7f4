"""Parity: every layout trains like one process from the same seed checkpoint and global batch.

Each layout is a named list of overrides with its process count. All runs read the data as 4
shards (training.dataset_shards) with a global batch of 8 rows, so they see identical batches.
"""

import pytest

from tests.helpers import TINY_RUN, read_metrics, run_train

TOLERANCE = 1e-4
GLOBAL = ["--training.dataset_shards", "4", "--training.deterministic"]

# name: (processes, overrides, a line the run must log); each keeps the global batch at 8 rows.
LAYOUTS = {
    "fsdp2": (2, ["--training.batch_size", "4"], "applied FSDP over mesh {'dp_shard_cp': 2}"),
    "hsdp2x2": (4, ["--training.batch_size", "2", "--training.data_parallel_replicate_degree", "2"],
                "applied HSDP over mesh {'dp_replicate': 2, 'dp_shard': 2}"),
    "fsdp2_accum2": (2, ["--training.batch_size", "2", "--training.gradient_accumulation_steps", "2"],
                     "applied FSDP over mesh {'dp_shard_cp': 2}"),
    "ac_full": (1, ["--training.batch_size", "8", "--activation_checkpoint.mode", "full"],
                "applied full activation checkpointing to 8 of 8 blocks"),
    "ac_selective2": (1, ["--training.batch_size", "8", "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_ac_option", "2"],
                      "applied selective activation checkpointing to 4 of 8 blocks"),
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    run_train([*TINY_RUN, "--job.dump_folder", str(root / "seed"), "--checkpoint.create_seed_checkpoint"])
    seed = ["--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0")]
    run_train([*TINY_RUN, *GLOBAL, *seed, "--job.dump_folder", str(root / "base"), "--training.batch_size", "8",
               "--activation_checkpoint.mode", "none"])
    return root, seed, read_metrics(root / "base")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(baseline, name):
    root, seed, base = baseline
    nproc, overrides, expected_log = LAYOUTS[name]
    result = run_train([*TINY_RUN, *GLOBAL, *seed, "--job.dump_folder", str(root / name),
                        "--activation_checkpoint.mode", "none", *overrides], nproc=nproc)
    assert "loaded model from" in result.stdout and expected_log in result.stdout
    runs = read_metrics(root / name)
    assert [r["step"] for r in runs] == [r["step"] for r in base] == list(range(1, 11))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base, runs)]
    print(f"{name}: max |loss diff| vs 1 process over 10 steps = {max(diffs):.3e}")
    assert max(diffs) <= TOLERANCE, [(a["loss"], b["loss"]) for a, b in zip(base, runs)]
    assert abs(base[-1]["grad_norm"] - runs[-1]["grad_norm"]) <= 1e-3 * base[-1]["grad_norm"]
    assert base[-1]["loss"] < base[0]["loss"], "the loss should fall over 10 steps"
