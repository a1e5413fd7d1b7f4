"""End to end through run_llama_train.sh: 2 CPU ranks with FSDP, overrides passed through."""

import os
import re
import signal
import subprocess

import pytest

from tests.helpers import REPO_ROOT, read_metrics, read_setup


def _launch(args, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(env)
    return subprocess.run(["./run_llama_train.sh", *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.fast
def test_two_rank_fsdp_run_through_launcher(tmp_path):
    result = _launch(["--training.steps", "6", "--training.seq_len", "64", "--metrics.log_freq", "1",
                      "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)], NGPU="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_setup(tmp_path)["fsdp"]["mesh"] == {"dp_shard_cp": 2}
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_second"] > 0 and 0 < r["mfu_percent"] < 100 for r in records)
    assert any((tmp_path / "tb").iterdir()), "TensorBoard events expected"
    # LOG_RANK defaults to 0: only rank 0's lines are shown.
    assert "[rank0]:" in result.stdout and "[rank1]:" not in result.stdout


def test_moe_expert_parallel_run_through_launcher(tmp_path):
    """Qwen3-MoE from its shipped config under EP 2: the experts split over the two ranks, every
    step's row carries the auxiliary loss and each layer's tokens per expert, the console line the
    summary."""
    result = _launch(["--training.steps", "3", "--training.seq_len", "64", "--metrics.log_freq", "1",
                      "--training.expert_parallel_degree", "2", "--job.dump_folder", str(tmp_path)],
                     NGPU="2", CONFIG_FILE="train_configs/qwen3_moe_debug.toml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    setup = read_setup(tmp_path)
    assert setup["model"]["name"] == "qwen3" and setup["model"]["flavor"] == "debugmodel_moe"
    assert setup["moe"]["ep_mesh"] == {"ep": 2} and setup["moe"]["experts_per_rank"] == 4
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["moe_aux_loss"] > 0
        for layer in range(setup["moe"]["layers"]):
            # Summed over both ranks: 2 x 8 sequences x 64 tokens x top-2 choices over 8 experts = 256 each on average.
            assert r[f"moe_mean_tokens_per_expert/layer{layer}"] == 256
            assert r[f"moe_max_tokens_per_expert/layer{layer}"] >= 256
    assert re.search(r"aux: \d\.\d{4}  experts max/mean: \d+\.\d\d \(layer \d\)", result.stdout)


@pytest.mark.fast
def test_launcher_rejects_bad_option_before_starting_ranks():
    result = _launch(["--training.stepz", "3"], NGPU="2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: unknown option --training.stepz; did you mean 'steps'?"], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.fast
def test_launcher_help_lists_options():
    result = _launch(["--help"])
    assert result.returncode == 0
    assert "--training.tensor_parallel_degree" in result.stdout



def test_launcher_refuses_a_pipeline_that_would_hang():
    """Too few microbatches for 1F1B's warm-up is refused by the pre-flight check, without torch."""
    result = _launch(["--experimental.pipeline_parallel_degree", "4", "--experimental.pipeline_parallel_microbatches",
                      "2"], NGPU="4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: pipeline schedule 1F1B needs at least 4 microbatches for 4 ranks x 1 stages, got 2; "
        "raise training.batch_size or experimental.pipeline_parallel_microbatches"], result.stderr


def test_error_on_rank_one_is_one_line_and_exit_two(tmp_path):
    """A mistake only rank 1 finds (its data shard is empty), with LOG_RANK=0 hiding rank 1's
    output: one `error:` line and exit code 2, without torchrun's failure report."""
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "%s"}\n' % ("one long document " * 400))
    result = _launch(["--training.steps", "3", "--training.seq_len", "64", "--training.dataset_path", str(data),
                      "--job.dump_folder", str(tmp_path / "out")], NGPU="2")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: {data} has no documents for data shard 1 of 2 (it is empty, or too small for "
        "training.dataset_shards)"], result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr and "ChildFailedError" not in result.stderr


def test_ctrl_c_stops_every_rank_after_one_step(tmp_path):
    """SIGINT to the launcher (what Ctrl-C sends): the ranks finish the step they are in, the newest
    checkpoint is named, the exit code is 130, and no rank is left running."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(["./run_llama_train.sh", "--training.steps", "10000", "--training.seq_len", "64",
                             "--metrics.log_freq", "1000", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
                             "--job.dump_folder", str(tmp_path)], cwd=REPO_ROOT, env={**env, "NGPU": "2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until training runs and a checkpoint exists
        if "saved checkpoint" in line:
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"stopped: SIGINT received; stopped after step (\d+); newest checkpoint: {tmp_path}/checkpoint/step-(\d+)",
        lines[0]), stderr[-3000:]
    step, saved = (int(n) for n in re.findall(r"step[- ](\d+)", lines[0]))
    assert saved <= step and saved % 2 == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, step]  # the stopped step is logged too
    assert "Traceback" not in stdout + stderr
    assert not [p for p in (tmp_path / "checkpoint").iterdir() if ".partial" in p.name]
    ranks = subprocess.run(["pgrep", "-f", f"torchtitan.train.*{tmp_path}"], capture_output=True, text=True)
    assert ranks.stdout == "", "a rank outlived the launcher"


def test_a_rendezvous_port_in_use_is_one_line_and_exit_two():
    """Node 0 cannot host the rendezvous (its port is taken): one `error:` line naming the
    endpoint, exit code 2, no torchrun traceback."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"127.0.0.1:{busy.getsockname()[1]}"
        result = _launch(["--training.steps", "2"], NGPU="1", NNODES="2", NODE_RANK="0", RDZV_ENDPOINT=endpoint)
    assert result.returncode == 2, result.stderr[-3000:]
    ours = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(ours) == 1 and ours[0].startswith(f"error: the 2 nodes did not meet at the rendezvous RDZV_ENDPOINT={endpoint} "
                                                 "(RendezvousConnectionError: "), result.stderr[-3000:]
    assert "address already in use" in ours[0] and "Traceback" not in result.stderr


def _free_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


WAITING = r"waiting: 1 of 2 nodes at the rendezvous RDZV_ENDPOINT={endpoint} after (\d+) s, missing NODE_RANK 1; " \
          r"the wait ends after RDZV_TIMEOUT={timeout} s"


@pytest.mark.fast
def test_a_node_that_never_comes_is_named_while_waiting_and_at_the_rdzv_timeout():
    """NNODES=2 with node 1 never started: node 0 says every RDZV_PROGRESS_INTERVAL seconds how long
    it has waited and that NODE_RANK 1 is missing, and ends at RDZV_TIMEOUT with one `error:` line
    naming it and the setting to raise, exit code 2 (issue 37)."""
    import time

    endpoint = _free_endpoint()
    start = time.monotonic()
    result = _launch(["--training.steps", "2"], NGPU="1", NNODES="2", NODE_RANK="0", RDZV_ENDPOINT=endpoint,
                     RDZV_TIMEOUT="4", RDZV_PROGRESS_INTERVAL="1")
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-3000:]
    *progress, last = result.stderr.strip().splitlines()
    waited = [int(re.fullmatch(WAITING.format(endpoint=endpoint, timeout=4), line)[1]) for line in progress]
    assert len(waited) >= 2 and waited == sorted(set(waited)) and waited[0] >= 1, result.stderr
    assert last == (f"error: the 2 nodes did not meet at the rendezvous RDZV_ENDPOINT={endpoint} within RDZV_TIMEOUT=4 s "
                    "(1 of 2 arrived, missing NODE_RANK 1); start the missing nodes with the same NNODES, RDZV_ENDPOINT "
                    "and RDZV_ID, or raise RDZV_TIMEOUT if they start later than that")
    # The wait is RDZV_TIMEOUT; the rest is start-up (the config check, torch's import) on a busy machine.
    assert waited[-1] <= 4 + 2 and elapsed < 4 + 20, elapsed


@pytest.mark.budget("two launchers, the second 3 s late on purpose, each starting a rank that imports torch")
def test_a_late_node_is_waited_for_and_then_nothing_more_is_said(tmp_path):
    """Node 1 starts 3 s after node 0 (both on this machine, one rank each): node 0 names it as
    missing until it comes, then says nothing more, and the job trains."""
    import time

    endpoint = _free_endpoint()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(NGPU="1", NNODES="2", RDZV_ENDPOINT=endpoint, RDZV_PROGRESS_INTERVAL="1", OMP_NUM_THREADS="1")
    args = ["./run_llama_train.sh", "--training.steps", "2", "--training.seq_len", "64", "--model.flavor", "tiny",
            "--job.dump_folder", str(tmp_path)]
    # Node 0's stderr into its stdout, in the order written: a rank's line marks the rendezvous' end.
    node0 = subprocess.Popen(args, cwd=REPO_ROOT, env={**env, "NODE_RANK": "0"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    node1 = subprocess.run(args, cwd=REPO_ROOT, env={**env, "NODE_RANK": "1"}, capture_output=True, text=True,
                           timeout=300)
    output, _ = node0.communicate(timeout=300)
    assert node0.returncode == 0 and node1.returncode == 0, output[-3000:] + node1.stderr[-3000:]
    lines = output.splitlines()
    first_rank_line = next(i for i, line in enumerate(lines) if line.startswith("[rank0]:"))
    waiting = [i for i, line in enumerate(lines) if line.startswith("waiting:")]
    assert waiting and max(waiting) < first_rank_line, output[-3000:]
    assert all(re.fullmatch(WAITING.format(endpoint=endpoint, timeout=600), lines[i]) for i in waiting), output[-3000:]
    assert "waiting:" not in node1.stderr and "error:" not in output + node1.stderr

