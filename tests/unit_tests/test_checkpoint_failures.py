"""Failed checkpoint reads and writes as one line; a save that would not fit is refused before writing."""

import errno
import os
import shutil
from collections import namedtuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint.failures import SpaceCheckingSavePlanner, free_bytes, one_line, read_only, save_failure

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STATE = {"model": {"w": torch.zeros(256, 256)}}  # 256 KiB


def test_dcps_per_rank_stacks_become_the_root_cause_and_the_rank(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointException) as e:
        dcp.save(STATE, checkpoint_id=str(tmp_path / "file" / "step-1"), no_dist=True)
    assert len(str(e.value)) > 500  # what DCP says: every rank's stack
    assert one_line(e.value) == f"Not a directory: {tmp_path}/file/step-1 (rank 0)"


def test_a_chained_error_is_reduced_to_its_first_sentence():
    try:
        try:
            raise RuntimeError("PytorchStreamReader failed reading zip archive: not a ZIP archive. This is an internal "
                               "miniz error.\nIf you are seeing this error, ...")
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as e:
        failure = CheckpointException("read_data", {1: (e, None)})
    assert one_line(failure) == "RuntimeError: PytorchStreamReader failed reading zip archive: not a ZIP archive (rank 1)"


def test_a_save_that_would_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**19, 2**19))  # 512 KiB free
    with pytest.raises(CheckpointException) as e:
        dcp.save(STATE, checkpoint_id=str(tmp_path / "step-1"), planner=SpaceCheckingSavePlanner(str(tmp_path / "step-1")),
                 no_dist=True)
    assert one_line(e.value) == (f"not enough space for the checkpoint: it needs 1.3 MiB, the disk holding {tmp_path} "
                                 "has 0.5 MiB free (rank 0)")
    assert os.listdir(tmp_path / "step-1") == []  # DCP made the folder; no file was written into it
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 0, 2**30))
    dcp.save(STATE, checkpoint_id=str(tmp_path / "step-2"), planner=SpaceCheckingSavePlanner(str(tmp_path / "step-2")),
             no_dist=True)


def test_a_save_failure_that_may_be_a_full_disk_says_how_much_is_free(tmp_path):
    failure = CheckpointException("write", {0: (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected "
                                                             "pos 704 vs 598"), None)})
    line = save_failure(failure, str(tmp_path))
    assert line.startswith("RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598 (rank 0) (")
    assert line.endswith(f"MiB free on the disk holding {tmp_path})")
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x"))
    assert save_failure(read_only, str(tmp_path)) == f"Read-only file system: {tmp_path}/x"


def test_free_space_that_cannot_be_measured_is_left_out(tmp_path, monkeypatch):
    def disk_usage(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    assert free_bytes(str(tmp_path / "not" / "yet")) is None
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))
    assert save_failure(full, str(tmp_path)) == f"No space left on device: {tmp_path}/x"


def test_a_read_only_disk_is_told_from_its_mount_and_an_unreadable_one_is_not_called_so(tmp_path, monkeypatch):
    assert not read_only(str(tmp_path / "not" / "yet"))  # the nearest existing folder's disk: writable
    flags = os.statvfs(tmp_path).f_flag

    def statvfs(path, flag=flags | os.ST_RDONLY):
        return type("Stat", (), {"f_flag": flag})()

    monkeypatch.setattr(os, "statvfs", statvfs)
    assert read_only(str(tmp_path / "out"))

    def unreadable(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "statvfs", unreadable)
    assert not read_only(str(tmp_path / "out"))
