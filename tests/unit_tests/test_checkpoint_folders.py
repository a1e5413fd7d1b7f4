"""Checkpoint folders: atomic publication, completeness checks, discovery and retention."""

import json
import os

import pytest

from torchtitan.checkpoint import folders
from torchtitan.checkpoint.folders import Manifest


def make_save(root, step, files=None, weights_only=False, publish=True):
    """A finished save: files written into a partial folder, published as step-N."""
    partial = root / folders.partial_name(step, "t")
    partial.mkdir(parents=True)
    for name, data in (files or {"__0_0.distcp": b"x" * 100, ".metadata": b"m" * 10}).items():
        (partial / name).write_bytes(data)
    contents = ["model"] if weights_only else ["model", "optimizer"]
    if publish:
        folders.publish(str(partial), str(root / folders.final_name(step)), Manifest(step, contents))
    return root / folders.final_name(step)


def test_publish_records_sizes_and_renames(tmp_path):
    path = make_save(tmp_path, 5)
    assert not list(tmp_path.glob("*.partial-*"))
    manifest = json.loads((path / folders.MANIFEST).read_text())
    assert manifest["files"] == {"__0_0.distcp": 100, ".metadata": 10}
    assert manifest["step"] == 5 and manifest["format"] == folders.FORMAT
    assert folders.problem_with(str(path)) is None


def test_publish_replaces_an_older_save_of_the_same_step(tmp_path):
    make_save(tmp_path, 5, files={"a": b"old"})
    partial = tmp_path / folders.partial_name(5, "u")
    partial.mkdir()
    (partial / "b").write_bytes(b"new!")
    folders.publish(str(partial), str(tmp_path / "step-5"), Manifest(5, ["model"]))
    assert sorted(os.listdir(tmp_path / "step-5")) == ["b", folders.MANIFEST]
    assert sorted(os.listdir(tmp_path)) == ["step-5"]


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: (p / "__0_0.distcp").write_bytes(b"x" * 40), "its file __0_0.distcp has 40 bytes, 100 were written"),
        (lambda p: (p / "__0_0.distcp").unlink(), "its file __0_0.distcp is missing"),
        (lambda p: (p / folders.MANIFEST).write_text("{not json"), "has a damaged manifest.json"),
        (lambda p: (p / folders.MANIFEST).write_text('{"format": "other"}'), "has a damaged manifest.json"),
        (lambda p: (p / folders.MANIFEST).unlink(), "has no manifest.json (its save never finished)"),
    ],
)
def test_damage_is_detected(tmp_path, damage, expected):
    path = make_save(tmp_path, 5)
    damage(path)
    assert expected in folders.problem_with(str(path))


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert folders.problem_with(str(tmp_path)) == "is not a checkpoint (no manifest.json and no DCP .metadata file)"
    assert folders.problem_with(str(tmp_path / "nope")) == "does not exist"
    assert folders.problem_with(str(tmp_path / "notes.txt")) == "is not a folder"


def test_scan_orders_by_step_and_lists_unfinished_saves(tmp_path):
    for step in (10, 2, 5):
        make_save(tmp_path, step)
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "step-12.partial-abc").mkdir()
    (tmp_path / "unrelated").mkdir()
    found, partial = folders.scan(str(tmp_path))
    assert [f.step for f in found] == [2, 5, 10]
    assert [f.problem is None for f in found] == [True, False, True]
    assert found[0].manifest.step == 2 and found[1].manifest is None
    assert partial == [str(tmp_path / "step-12.partial-abc")]
    assert folders.scan(str(tmp_path / "missing")) == ([], [])


def test_keep_latest_k(tmp_path):
    for step in (2, 4, 6, 8):
        make_save(tmp_path, step)
    found, _ = folders.scan(str(tmp_path))
    assert [f.step for f in folders.to_purge(found, 2)] == [2, 4]
    assert folders.to_purge(found, 0) == []
    assert folders.to_purge(found, 4) == []


def test_keep_latest_k_never_removes_the_newest_resumable_checkpoint(tmp_path):
    make_save(tmp_path, 4)
    make_save(tmp_path, 6)
    make_save(tmp_path, 8, weights_only=True)  # the final, weights-only export
    found, _ = folders.scan(str(tmp_path))
    assert [f.step for f in folders.to_purge(found, 1)] == [4]  # 6 stays: the only full one left


def test_keep_latest_k_counts_and_removes_only_complete_checkpoints(tmp_path):
    make_save(tmp_path, 2)
    make_save(tmp_path, 4)
    (tmp_path / "step-4" / "__0_0.distcp").unlink()  # damaged: neither counted nor removed
    found, _ = folders.scan(str(tmp_path))
    assert folders.to_purge(found, 1) == []  # step 2 is the only complete checkpoint


def test_remove_takes_the_folder_out_of_the_step_namespace_first(tmp_path):
    path = make_save(tmp_path, 3)
    folders.remove(str(path))
    assert os.listdir(tmp_path) == []
