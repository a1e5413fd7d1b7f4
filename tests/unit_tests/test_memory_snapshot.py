"""profiling.enable_memory_snapshot: CUDA allocator history dumped every profile_freq steps and at an
out-of-memory error, refused in one line where there is no CUDA.

This machine has no GPU, so the CUDA side runs against stand-ins for torch.cuda.memory's two
private functions that record what they were asked and write a file where a snapshot would go.
"""

from __future__ import annotations

import gc
import pickle
import re
from pathlib import Path

import pytest
import torch

import torchtitan.observability.profiling
import torchtitan.train
import torchtitan.trainer.step
from tests.helpers import TINY_RUN, run_train
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.errors import ConfigError
from torchtitan.observability.profiling import (
    MEMORY_SNAPSHOT_MAX_ENTRIES,
    check_memory_snapshot_support,
    maybe_enable_memory_snapshot,
)

SNAPSHOT = "rank{rank}_memory_snapshot.pickle"


class FakeCudaMemory:
    """Stands for torch.cuda.memory._record_memory_history and _dump_snapshot."""

    def __init__(self):
        self.history_calls: list[tuple[str | None, int | None]] = []
        self.dumps: list[Path] = []

    @property
    def recording(self) -> bool:
        return bool(self.history_calls) and self.history_calls[-1][0] is not None

    def record_memory_history(self, enabled="all", *args, max_entries=None, **kwargs):
        self.history_calls.append((enabled, max_entries))

    def dump_snapshot(self, filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        assert self.recording, "a snapshot was dumped while no history was being recorded"
        path = Path(filename)
        path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "dump": len(self.dumps)}))
        self.dumps.append(path)


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCudaMemory:
    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump_snapshot)
    return fake


def config(tmp_path: Path, *args: str):
    return parse_args(["--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot", *args])


def snapshot_folders(tmp_path: Path, rank: int = 0) -> list[str]:
    root = tmp_path / "memory_snapshot"
    files = root.glob(f"*/{SNAPSHOT.format(rank=rank)}")
    return sorted((p.parent.name for p in files), key=lambda name: (int(name.split("_")[1]), name))


# ---------------------------------------------------------------------------------------------
# Refused where there is no CUDA


def test_refused_by_the_check_for_devices_without_cuda(tmp_path):
    job_config = config(tmp_path)
    with pytest.raises(ConfigError, match="profiling.enable_memory_snapshot .* needs a CUDA GPU; this job runs on cpu"):
        check_memory_snapshot_support(job_config, "cpu")
    check_memory_snapshot_support(job_config, "cuda")  # a dry run standing for a CUDA cluster accepts it
    check_memory_snapshot_support(parse_args(["--job.dump_folder", str(tmp_path)]), "cpu")  # off: nothing to refuse


def test_preflight_refuses_it_on_cpu(tmp_path):
    with pytest.raises(ConfigError, match="profiling.enable_memory_snapshot"):
        preflight(config(tmp_path, "--job.config_file", "bundled:train_configs/debug_model.toml"), 1, device_type="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: snapshots are accepted")
def test_a_run_without_cuda_ends_with_one_line(tmp_path):
    result = run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot"], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "profiling.enable_memory_snapshot records the CUDA caching allocator" in lines[0], \
        result.stderr[-2000:]
    assert not (tmp_path / "memory_snapshot").exists()


# ---------------------------------------------------------------------------------------------
# The context manager, with CUDA stood in for


def test_off_yields_none_and_records_nothing(tmp_path, fake_cuda):
    with maybe_enable_memory_snapshot(parse_args(["--job.dump_folder", str(tmp_path)]), rank=0) as snapshot:
        assert snapshot is None
    assert fake_cuda.history_calls == []


def test_without_cuda_the_context_refuses_too(tmp_path, fake_cuda, monkeypatch):
    """A caller that skipped preflight (a script) gets the same line, and nothing is recorded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        with maybe_enable_memory_snapshot(config(tmp_path), rank=0):
            pass
    assert fake_cuda.history_calls == []


def test_dumps_every_profile_freq_steps_and_stops_recording(tmp_path, fake_cuda, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    caplog.set_level("INFO", logger="torchtitan.observability.profiling")
    with maybe_enable_memory_snapshot(config(tmp_path, "--profiling.profile_freq", "3"), rank=1) as snapshot:
        assert fake_cuda.recording
        assert fake_cuda.history_calls == [("all", MEMORY_SNAPSHOT_MAX_ENTRIES)]
        for _ in range(7):
            snapshot.step()
    assert snapshot_folders(tmp_path, rank=1) == ["iteration_3", "iteration_6"]
    assert not fake_cuda.recording and fake_cuda.history_calls[-1][0] is None
    written = [r.getMessage() for r in caplog.records if "memory snapshot written to" in r.getMessage()]
    assert len(written) == 2
    assert str(tmp_path / "memory_snapshot" / "iteration_6" / "rank1_memory_snapshot.pickle") in written[1]
    assert re.search(r" in \d+\.\d\ds ", written[1])  # the time it took


def test_a_resumed_run_names_folders_by_the_global_step(tmp_path, fake_cuda, monkeypatch):
    """Snapshots fall on multiples of profile_freq of the job's step count, whatever step it resumed at."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with maybe_enable_memory_snapshot(config(tmp_path, "--profiling.profile_freq", "3"), rank=0,
                                      global_step=4) as snapshot:
        for _ in range(6):  # steps 5 to 10
            snapshot.step()
    assert snapshot_folders(tmp_path) == ["iteration_6", "iteration_9"]


def test_out_of_memory_dumps_once_more_and_is_raised_again(tmp_path, fake_cuda, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with maybe_enable_memory_snapshot(config(tmp_path, "--profiling.profile_freq", "2"), rank=0,
                                          global_step=10) as snapshot:
            for _ in range(3):  # steps 11, 12, 13
                snapshot.step()
            raise oom  # in step 14
    assert raised.value is oom
    assert snapshot_folders(tmp_path) == ["iteration_12", "iteration_13_exit"]
    assert not fake_cuda.recording
    assert any("ran out of memory after step 13" in r.getMessage() and "iteration_13_exit" in r.getMessage()
               for r in caplog.records)


def test_other_errors_dump_nothing_more_but_stop_recording(tmp_path, fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(KeyError):
        with maybe_enable_memory_snapshot(config(tmp_path), rank=0) as snapshot:
            snapshot.step()
            raise KeyError("not memory")
    assert snapshot_folders(tmp_path) == []
    assert not fake_cuda.recording


def test_a_snapshot_that_cannot_be_written_leaves_the_out_of_memory_error(tmp_path, fake_cuda, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def full_disk(filename, augment_with_fx_traces=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", full_disk)
    with pytest.raises(torch.OutOfMemoryError):
        with maybe_enable_memory_snapshot(config(tmp_path), rank=0):
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert not fake_cuda.recording
    assert any("could not be written" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# Wired into the real training loop (in this process, on CPU, the CUDA calls stood in for)


@pytest.fixture
def trainer_with_fake_cuda(fake_cuda, monkeypatch):
    """The trainer as it would run on CUDA, as far as snapshots go: the device checks let the option
    through and the allocator calls go to the stand-ins."""
    # preflight runs the rule from torchtitan.observability.profiling (torchtitan/config/rules.py), as the loop does.
    monkeypatch.setattr(torchtitan.observability.profiling, "check_memory_snapshot_support", lambda *args: None)
    with torch.random.fork_rng():
        yield fake_cuda
    gc.enable()  # the training loop turns automatic collection off


def tiny_run(tmp_path: Path, *args: str):
    return parse_args([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--metrics.peak_tflops", "1",
                       "--profiling.enable_memory_snapshot", *args])


def test_the_training_loop_dumps_at_its_steps(tmp_path, trainer_with_fake_cuda):
    torchtitan.train.train(tiny_run(tmp_path, "--training.steps", "5", "--profiling.profile_freq", "2"))
    assert snapshot_folders(tmp_path) == ["iteration_2", "iteration_4"]
    assert not trainer_with_fake_cuda.recording


def test_out_of_memory_in_the_training_loop_is_dumped(tmp_path, trainer_with_fake_cuda, monkeypatch):
    real_forward_backward = torchtitan.trainer.step.forward_backward
    calls = []

    def runs_out_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_forward_backward(*args, **kwargs)

    monkeypatch.setattr(torchtitan.trainer.step, "forward_backward", runs_out_in_step_3)
    with pytest.raises(torch.OutOfMemoryError):
        torchtitan.train.train(tiny_run(tmp_path, "--training.steps", "5", "--profiling.profile_freq", "2"))
    assert snapshot_folders(tmp_path) == ["iteration_2", "iteration_2_exit"]
    assert not trainer_with_fake_cuda.recording
