"""Tests for torchtitan.observability.metrics: the MFU peak (GPU table, cached CPU peak, override), metrics.jsonl
across fresh and resumed runs, the optional Weights & Biases sink (with a fake wandb module), and metrics files on
a full or read-only disk (one warning each, the run goes on)."""

import errno
import json
import logging
import os
import platform
import re
import sys
import types

import pytest
import torch

from tests.faults.free_space import fill_disk_under, noting_open
from torchtitan.config.manager import ConfigError, JobConfig, parse_args
from torchtitan.observability import metrics
from torchtitan.observability.metrics import MetricsLogger, StepMetrics, gpu_peak_flops, peak_flops
from torchtitan.tools.runs import read_metrics, read_setup


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.CACHE_DIR_ENV, str(tmp_path / "cache"))


@pytest.fixture
def measured(monkeypatch):
    """Replaces the matmul probe with a counter, so tests see when a peak is measured."""
    calls = []

    def fake(dtype=torch.float32):
        calls.append(dtype)
        return 1e11 * len(calls)

    monkeypatch.setattr(metrics, "measure_cpu_peak_flops", fake)
    return calls


def config_in(tmp_path, **metrics_options) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "dump")
    for key, value in metrics_options.items():
        setattr(config.metrics, key, value)
    return config


def step(n: int) -> StepMetrics:
    return StepMetrics(step=n, loss=2.5, grad_norm=0.5, lr=1e-3, tokens=1000.0, seconds=0.5, data_seconds=0.1)


# ----------------------------------------------------------------------------- the MFU peak


@pytest.mark.parametrize("name,bf16,fp32,tf32", [
    ("NVIDIA H100 80GB HBM3", 989, 67, 495),
    ("NVIDIA H100 PCIe", 756, 51, 378),
    ("NVIDIA H100 NVL", 835, 60, 418),
    ("NVIDIA H200", 989, 67, 495),
    ("NVIDIA GH200 480GB", 989, 67, 495),
    ("NVIDIA A100-SXM4-80GB", 312, 19.5, 156),
    ("NVIDIA A100 80GB PCIe", 312, 19.5, 156),
    ("NVIDIA L40S", 362, 91.6, 183),
    ("NVIDIA L40", 181, 90.5, 90.5),
    ("NVIDIA L4", 121, 30.3, 60),
    ("AMD Instinct MI300X", 1307, 163, 654),
])
def test_gpu_peaks_come_from_the_datasheet_table(name, bf16, fp32, tf32):
    assert gpu_peak_flops(name, torch.bfloat16) == pytest.approx(bf16 * 1e12)
    assert gpu_peak_flops(name, torch.float32) == pytest.approx(fp32 * 1e12)
    assert gpu_peak_flops(name, torch.float32, tf32=True) == pytest.approx(tf32 * 1e12)


def test_unknown_gpu_has_no_table_entry():
    assert gpu_peak_flops("Tesla T4", torch.bfloat16) is None


def test_peak_override_wins_and_measures_nothing(measured):
    peak, source = peak_flops(torch.device("cpu"), torch.float32, override_tflops=2.5)
    assert peak == pytest.approx(2.5e12) and source == "metrics.peak_tflops"
    assert measured == []


def test_cpu_peak_is_measured_once_per_cpu_threads_and_dtype(measured, monkeypatch, tmp_path):
    first, source = peak_flops(torch.device("cpu"), torch.float32)
    assert len(measured) == 1 and "measured now" in source
    again, source = peak_flops(torch.device("cpu"), torch.float32)
    assert again == first and len(measured) == 1 and "cached" in source
    assert peak_flops(torch.device("cpu"), torch.bfloat16)[0] != first and len(measured) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert peak_flops(torch.device("cpu"), torch.float32)[0] != first and len(measured) == 3
    cache = json.loads((tmp_path / "cache" / "cpu_peak_flops.json").read_text())
    assert len(cache) == 3 and any("| 97 threads | float32" in key for key in cache)


def test_damaged_cpu_peak_cache_is_measured_again(measured, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_peak_flops.json").write_text("{not json")
    peak, _ = peak_flops(torch.device("cpu"), torch.float32)
    assert peak > 0 and len(measured) == 1
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == peak and len(measured) == 1


def test_unwritable_cache_still_gives_a_peak(measured, monkeypatch, tmp_path):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(metrics.CACHE_DIR_ENV, str(tmp_path / "a_file"))
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    assert peak > 0 and "not cached" in source
    metrics.raise_cpu_peak(torch.float32, 10 * peak)  # a run faster than the figure: no error either
    assert (tmp_path / "a_file").read_text() == ""


def test_a_cpu_without_proc_cpuinfo_is_named_by_the_platform(measured, monkeypatch):
    def no_proc(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            raise FileNotFoundError(2, "No such file or directory", path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", no_proc, raising=False)
    name = platform.processor() or platform.machine()
    assert name and metrics._cpu_model() == name
    assert f"for '{name} | " in peak_flops(torch.device("cpu"), torch.float32)[1]


def test_two_runs_report_the_same_mfu(tmp_path):
    """The real probe, once: a second run on this machine divides by the same cached peak."""
    mfus = []
    for run in range(2):
        logger = MetricsLogger(config_in(tmp_path / str(run)), torch.device("cpu"), flops_per_token=10**6, rank=0)
        mfus.append(logger.log(step(1))["mfu_percent"])
        logger.close()
    assert mfus[0] == mfus[1] > 0


def test_a_peak_measured_on_a_busy_machine_is_raised_once(measured, tmp_path):
    """The cached figure (1e11) is below what a run computes (1e12 FLOP/s): measured again once,
    the higher figure is kept for later runs, and this run's MFU stays against its own peak."""
    peak_flops(torch.device("cpu"), torch.float32)  # caches the first (low) measurement
    logger = MetricsLogger(config_in(tmp_path / "busy"), torch.device("cpu"), flops_per_token=10**9, rank=0)
    first = logger.log(step(1))["mfu_percent"]  # 2000 tokens/s x 1e9 FLOP = 2e12 FLOP/s
    assert first == pytest.approx(2000.0) and len(measured) == 2
    assert logger.log(step(2))["mfu_percent"] == first and len(measured) == 2  # once per run
    logger.close()
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == 2e12  # the run's figure beat the re-measurement
    later = MetricsLogger(config_in(tmp_path / "later"), torch.device("cpu"), flops_per_token=10**9, rank=0)
    assert later.log(step(1))["mfu_percent"] == pytest.approx(100.0)
    later.close()


def test_measured_cpu_peak_is_positive():
    assert metrics.measure_cpu_peak_flops(torch.float32, seconds=0.05, n=64) > 0


# ----------------------------------------------------------------------------- metrics.jsonl


def run_steps(tmp_path, steps, resumed_step=0):
    logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0), torch.device("cpu"), 10**6, rank=0,
                           resumed_step=resumed_step)
    for n in steps:
        logger.log(step(n))
    logger.close()


def read_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_fresh_runs_never_mix_nor_lose_earlier_metrics(tmp_path):
    dump = tmp_path / "dump"
    run_steps(tmp_path, [1, 2, 3])
    run_steps(tmp_path, [1, 2])
    assert read_steps(dump / "metrics.jsonl") == [1, 2]
    assert read_steps(dump / "metrics.1.jsonl") == [1, 2, 3]
    run_steps(tmp_path, [1])
    assert read_steps(dump / "metrics.jsonl") == [1]
    assert read_steps(dump / "metrics.2.jsonl") == [1, 2]  # a larger n is a later run
    assert read_steps(dump / "metrics.1.jsonl") == [1, 2, 3]


def test_resumed_run_appends_after_its_checkpoint_step(tmp_path):
    dump = tmp_path / "dump"
    run_steps(tmp_path, [1, 2, 3, 4])
    with open(dump / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a killed job's half-written last row
    run_steps(tmp_path, [3, 4, 5], resumed_step=2)  # steps 3 and 4 are trained again
    assert read_steps(dump / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert not (dump / "metrics.1.jsonl").exists()


def run_with_setup(tmp_path, first_step, steps):
    """A run as train.py makes it: its setup record right after its first step, before that step's row."""
    logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0), torch.device("cpu"), 10**6, rank=0,
                           resumed_step=first_step - 1)
    for n in steps:
        if n == first_step:
            logger.log_record({"record": "setup", "first_step": first_step})
        logger.log(step(n))
    logger.close()


def rows(path) -> list[str]:
    """Each line of a metrics file as "setup <first_step>" or "<step>"."""
    return [f"setup {r['first_step']}" if r.get("record") == "setup" else str(r["step"])
            for r in map(json.loads, path.read_text().splitlines())]


def test_setup_records_stay_with_the_steps_their_run_trained(tmp_path):
    dump = tmp_path / "dump"
    run_with_setup(tmp_path, 1, [1, 2, 3, 4])
    run_with_setup(tmp_path, 3, [3, 4, 5, 6])  # resumed after step 2: the first run's steps 3, 4 go
    run_with_setup(tmp_path, 5, [5, 6, 7])  # resumed after step 4: the second run's steps 3, 4 stay, with its record
    assert rows(dump / "metrics.jsonl") == ["setup 1", "1", "2", "setup 3", "3", "4", "setup 5", "5", "6", "7"]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5, 6, 7]  # step rows only, as before
    assert read_setup(dump) == {"record": "setup", "first_step": 5}
    run_with_setup(tmp_path, 3, [3])  # resumed after step 2 again: the records of the runs that began later go
    assert rows(dump / "metrics.jsonl") == ["setup 1", "1", "2", "setup 3", "3"]
    run_steps(tmp_path, [1])  # a fresh run that wrote no record: the earlier file moves aside, records and all
    assert read_setup(dump) is None and rows(dump / "metrics.1.jsonl") == ["setup 1", "1", "2", "setup 3", "3"]


def test_colours_off_with_either_spelling(tmp_path):
    for options in ({"disable_color_printing": True}, {"enable_color_printing": False}):
        logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0, save_jsonl=False, **options),
                               torch.device("cpu"), 10**6, rank=0)
        assert logger.colors.red == ""
    assert MetricsLogger(config_in(tmp_path, peak_tflops=1.0, save_jsonl=False), torch.device("cpu"), 10**6,
                         rank=0).colors.red != ""


# ----------------------------------------------------------------------------- Weights & Biases


def test_enable_wandb_without_the_package_is_refused_before_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like to import
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb needs the wandb package \(pip install wandb\)$"):
        parse_args(["--metrics.enable_wandb"])
    assert parse_args(["--metrics.enable_wandb", "false"]).metrics.enable_wandb is False


class FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: runs.append(FakeRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_wandb_logs_the_same_scalars_on_rank_0(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    config = parse_args(["--metrics.enable_wandb", "--job.dump_folder", str(tmp_path / "dump"),
                         "--metrics.peak_tflops", "1"])
    logger = MetricsLogger(config, torch.device("cpu"), 10**6, rank=0)
    values = [logger.log(step(1)), logger.log(step(10))]
    logger.close()
    (run,) = fake_wandb
    assert run.init_kwargs["dir"] == str(tmp_path / "dump") and run.init_kwargs["project"] == "torchtitan"
    assert run.init_kwargs["config"]["metrics"]["enable_wandb"] is True
    assert [s for s, _ in run.logged] == [1, 10]
    for (_, logged), expected in zip(run.logged, values):
        assert logged == {f"train/{name}": value for name, value in expected.items()}
        assert {"train/loss", "train/mfu_percent", "train/tokens_per_second"} <= logged.keys()
    assert run.finished
    # Other ranks open no run.
    MetricsLogger(config, torch.device("cpu"), 10**6, rank=1).close()
    assert len(fake_wandb) == 1


# ----------------------------------------------------------------------------- validation and summary rows


def run_with_validation(tmp_path, steps, validations, resumed_step=0) -> MetricsLogger:
    """A run logging `steps`, with a validation loss of validations[n] after step n where given."""
    logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0), torch.device("cpu"), 10**6, rank=0,
                           resumed_step=resumed_step)
    for n in steps:
        logger.log(step(n))
        if n in validations:
            logger.log_validation(n, validations[n], 2.0, 1, 64, 0.1)
    return logger


def test_validation_rows_and_best_loss_survive_a_resume(tmp_path):
    dump = tmp_path / "dump"
    run_with_validation(tmp_path, [1, 2, 3, 4], {2: 3.0, 4: 2.0}).close()
    # Resumed after step 3: the validation of step 2 stays (and is the history), that of step 4 goes.
    logger = run_with_validation(tmp_path, [4, 5, 6], {6: 2.5}, resumed_step=3)
    assert logger.validations == {2: 3.0, 6: 2.5}
    logger.close()
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows if r.get("record") == "validation"] == [(2, 3.0), (6, 2.5)]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5, 6]  # step rows unchanged


def test_a_summary_row_goes_with_the_steps_it_summed(tmp_path):
    dump = tmp_path / "dump"
    logger = run_with_validation(tmp_path, [1, 2, 3, 4], {})
    logger.log_record({"record": "summary", "first_step": 1, "last_step": 4})
    logger.close()
    run_with_validation(tmp_path, [3], {}, resumed_step=2).close()  # steps 3, 4 trained again: the summary goes
    kinds = [json.loads(line).get("record", "step") for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["step"] * 3


def test_mean_throughput_covers_every_logged_window(tmp_path):
    logger = run_with_validation(tmp_path, [1, 2, 3], {})
    tps, mfu = logger.mean_throughput()
    assert tps == pytest.approx(3000 / 1.5)  # each window: 1000 tokens in 0.5 s
    assert mfu == pytest.approx(100 * 10**6 * tps / 1e12)
    logger.close()


def test_validation_goes_to_tensorboard_beside_the_training_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0, enable_tensorboard=True), torch.device("cpu"), 10**6,
                           rank=0)
    logger.log(step(2))
    logger.log_validation(2, 3.5, 33.1, 4, 1024, 0.2)
    logger.close()
    events = EventAccumulator(str(tmp_path / "dump" / "tb"))
    events.Reload()
    assert {"train/loss", "validation/loss", "validation/perplexity"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("validation/loss")] == [(2, 3.5)]


# ----------------------------------------------------------------------------- a full or read-only disk


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


GOES_ON = ("it is not written for the rest of this run, which trains on: the step lines still print and checkpoints "
           "are saved as before (a save that does not fit ends the run with exit code 4)")


def test_a_disk_that_fills_up_stops_each_metrics_file_with_one_warning_and_the_run_goes_on(tmp_path, caplog,
                                                                                            monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan.observability import metric_files

    opened = []
    monkeypatch.setattr(metric_files, "open", noting_open(opened), raising=False)
    logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0, enable_tensorboard=True), torch.device("cpu"), 10**6,
                           rank=0)
    logger.log(step(1))
    fill_disk_under(opened)  # the kernel's ENOSPC from here on, as on a disk that filled up
    with caplog.at_level(logging.WARNING):
        assert logger.log(step(2))["loss"] == 2.5  # the figures are still computed (and printed)
        logger.log_validation(2, 3.5, 33.1, 4, 1024, 0.2)
        logger.log(step(3))
        logger.log_record({"record": "summary", "first_step": 1, "last_step": 3})
        logger.close()
    dump = tmp_path / "dump"
    free = r"No space left on device, [\d.,]+ MiB free on the disk holding \S+; "
    expected = [f"cannot write the TensorBoard event file {logger.writer.path} at step 2: ",
                f"cannot write the metrics file {dump}/metrics.jsonl at step 2: "]
    assert len(warnings_of(caplog)) == 2
    for warning, start in zip(warnings_of(caplog), expected):
        assert re.fullmatch(re.escape(start) + free + re.escape(GOES_ON), warning), warning
    assert logger.jsonl.stopped.startswith("at step 2: No space left on device")  # for the run's summary
    assert [r["step"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())] == [1]
    accumulator = EventAccumulator(str(dump / "tb"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/loss")] == [1]  # what was written before stays readable


def test_a_read_only_disk_stops_the_metrics_files_at_start_up_with_one_warning(tmp_path, caplog, monkeypatch):
    from torchtitan.observability import metric_files

    def read_only(path, *args, **kwargs):  # what open() meets on a read-only mount
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(metric_files, "open", read_only, raising=False)
    with caplog.at_level(logging.WARNING):
        logger = MetricsLogger(config_in(tmp_path, peak_tflops=1.0, enable_tensorboard=True), torch.device("cpu"),
                               10**6, rank=0)
        assert logger.log(step(1))["loss"] == 2.5
        logger.close()
    assert warnings_of(caplog) == [
        f"cannot write the metrics file {tmp_path}/dump/metrics.jsonl at start-up: Read-only file system; {GOES_ON}",
        f"cannot write the TensorBoard event file {logger.writer.path} at start-up: Read-only file system; {GOES_ON}"]


def test_a_full_disk_whose_free_space_cannot_be_measured_is_said_without_it(tmp_path):
    from torchtitan.observability import metric_files

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert metric_files._reason(full, str(tmp_path / "gone" / "metrics.jsonl")) == "No space left on device"
    assert metric_files._reason(full, str(tmp_path / "metrics.jsonl")).startswith("No space left on device, ")
