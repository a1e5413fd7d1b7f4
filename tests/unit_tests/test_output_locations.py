"""Output folders are checked at start-up: a file, a path under a file, or an unwritable disk is
one ConfigError naming the option; nothing is created or left behind."""

import errno
import os
import tempfile

import pytest

from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.config.output_locations import check_output_locations


def config(dump, *extra):
    return parse_args(["--job.dump_folder", str(dump), *extra])


def test_a_folder_that_does_not_exist_yet_is_fine_and_is_not_created(tmp_path):
    check_output_locations(config(tmp_path / "new" / "run", "--checkpoint.enable_checkpoint"))
    assert os.listdir(tmp_path) == []  # no folder, no probe file left


@pytest.mark.parametrize("layout, dump, extra, expected", [
    ({"run": "a file"}, "run", (), "job.dump_folder {tmp}/run is a file, not a folder"),
    ({"run": "a file"}, "run/sub/deeper", (), "job.dump_folder {tmp}/run/sub/deeper cannot be created: {tmp}/run is a file"),
    ({"run/checkpoint": "a file"}, "run", ("--checkpoint.enable_checkpoint",),
     "checkpoint.folder {tmp}/run/checkpoint is a file, not a folder"),
    ({"run/ckpt": "a file"}, "run", ("--checkpoint.create_seed_checkpoint", "--checkpoint.folder", "ckpt/seed"),
     "checkpoint.folder {tmp}/run/ckpt/seed cannot be created: {tmp}/run/ckpt is a file"),
    ({"run/tb": "a file"}, "run", ("--metrics.enable_tensorboard",), "metrics.save_tb_folder {tmp}/run/tb is a file, not a folder"),
])
def test_a_file_in_the_way_is_named_with_its_option(tmp_path, layout, dump, extra, expected):
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        check_output_locations(config(tmp_path / dump, *extra))
    assert str(e.value) == expected.format(tmp=tmp_path)


def test_a_broken_symbolic_link_is_named(tmp_path):
    """outputs -> /scratch/... with /scratch not mounted: refused at start-up, not after the model is built."""
    (tmp_path / "dangle").symlink_to(tmp_path / "not" / "mounted")
    for dump, expected in ((tmp_path / "dangle", "is a broken symbolic link"),
                           (tmp_path / "dangle" / "run", "cannot be created: " + str(tmp_path / "dangle"))):
        with pytest.raises(ConfigError, match=expected):
            check_output_locations(parse_args(["--job.dump_folder", str(dump)]))


def test_the_checkpoint_folder_is_checked_only_when_checkpoints_are_written(tmp_path):
    (tmp_path / "checkpoint").write_text("a file")
    check_output_locations(config(tmp_path))


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_an_unwritable_folder_is_refused(tmp_path, monkeypatch, code):
    # Root ignores permission bits, so the file system's answer is injected.
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError) as e:
        check_output_locations(config(tmp_path / "run"))
    assert str(e.value) == (f"job.dump_folder {tmp_path}/run is not writable: {os.strerror(code)} (its nearest existing "
                            f"folder {tmp_path} is not writable)")
