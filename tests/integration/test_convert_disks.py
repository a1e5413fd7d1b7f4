"""scripts/convert_checkpoint.py onto a disk that refuses its output: too little free space (refused before
anything is written), a read-only disk, a disk that fills up while writing. Each is one `error:` line,
exit status 2, and nothing left behind, whichever writer met it (Python's open, DCP, safetensors,
torch.save's zip writer)."""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from scripts import convert_checkpoint
from tests.helpers import REPO_ROOT
from tests.integration.test_convert_checkpoint import TINY, assert_one_error_line, convert_here, make_hf_folder
from torchtitan.checkpoint import failures
from torchtitan.checkpoint.weights import write_failure

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

COMMANDS = ("hf-to-dcp", "dcp-to-hf", "dcp-to-torch", "torch-to-dcp")
FIX = "(nothing was left there)"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A Hugging Face folder, its conversion to DCP and to a torch.save file: the input of each command."""
    root = tmp_path_factory.mktemp("inputs")
    hf = make_hf_folder(root / "hf", **TINY)
    assert convert_checkpoint.main(["hf-to-dcp", str(hf), str(root / "dcp")]) == 0
    assert convert_checkpoint.main(["dcp-to-torch", str(root / "dcp"), str(root / "model.pt")]) == 0
    return {"hf-to-dcp": str(hf), "dcp-to-hf": str(root / "dcp"), "dcp-to-torch": str(root / "dcp"),
            "torch-to-dcp": str(root / "model.pt")}


def output_of(command: str, folder) -> str:
    return os.path.join(folder, "out.pt" if command == "dcp-to-torch" else "out")


@pytest.mark.fast
def test_an_output_larger_than_the_free_space_is_refused_before_writing(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(failures, "free_bytes", lambda path: 2**19)  # 0.5 MiB; the tensors take 0.7
    for command in COMMANDS:
        out = output_of(command, tmp_path)
        status, stderr = convert_here(capsys, command, inputs[command], out)
        assert_one_error_line(status, stderr, f"error: not enough space for {out}: its tensors need 0.7 MiB, the disk "
                                              f"holding {tmp_path} has 0.5 MiB free; free space there or write it to "
                                              "another folder")
        assert os.listdir(tmp_path) == [], command


@pytest.mark.fast
def test_a_write_the_disk_refuses_is_one_line_and_leaves_nothing(inputs, tmp_path, capsys, monkeypatch):
    """The first folder each command creates meets a read-only disk (EROFS, as os.mkdir reports it there);
    the real disks, and the writers that report them in their own words, are the next test's."""
    real_mkdir = os.mkdir

    def read_only_mkdir(path, *args, **kwargs):
        if str(tmp_path) in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    for command in ("hf-to-dcp", "dcp-to-hf", "torch-to-dcp"):
        out = output_of(command, tmp_path)
        status, stderr = convert_here(capsys, command, inputs[command], out)
        assert_one_error_line(status, stderr, f"error: cannot write {out}: Read-only file system; write it to another "
                                              f"folder {FIX}")
        assert os.listdir(tmp_path) == [], command
    assert write_failure(RuntimeError("shape mismatch")) is None and write_failure(KeyError("w")) is None  # bugs


# The converter in a mount namespace of its own, onto two small tmpfs mounts of 256 KiB, which the
# 0.7 MiB of tensors do not fit, one of them read-only (said as read-only, not as too small). `filled`
# cases skip the free-space check, as when the disk fills up after it, so the writers themselves meet
# the full disk.
DRIVER = """
import contextlib, io, json, os, subprocess, sys
from scripts import convert_checkpoint
read_only, full, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,ro", "tmpfs", read_only], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", full], check=True)
check_room, results = convert_checkpoint.check_room, {}
for name, (args, filled) in cases.items():
    convert_checkpoint.check_room = (lambda out, nbytes: None) if filled else check_room
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = convert_checkpoint.main(args)
    results[name] = [status, err.getvalue(), os.listdir(read_only) + os.listdir(full)]
print("RESULT " + json.dumps(results))
"""


def _unshare() -> list[str] | None:
    if shutil.which("unshare") is None:
        return None
    command = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    return command if subprocess.run([*command, "true"], capture_output=True).returncode == 0 else None


def test_a_read_only_or_full_disk_is_one_line_whichever_writer_meets_it(inputs, tmp_path):
    unshare = _unshare()
    if unshare is None:
        pytest.skip("needs mount namespaces (unshare --mount, as root or with user namespaces) for real tmpfs disks")
    read_only, full = tmp_path / "read_only", tmp_path / "full"
    read_only.mkdir(), full.mkdir()
    cases = {f"read-only {c}": ([c, inputs[c], output_of(c, read_only)], False) for c in COMMANDS}
    cases.update({f"full {c}": ([c, inputs[c], output_of(c, full)], True) for c in COMMANDS})
    cases["full dcp-to-hf, fresh layout"] = (["dcp-to-hf", inputs["dcp-to-hf"], output_of("x", full), "--fresh-layout"],
                                             True)  # safetensors' writer, not the original files rebuilt
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*unshare, sys.executable, "-c", DRIVER, str(read_only), str(full), json.dumps(cases)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.split("RESULT ", 1)[1])
    for name, (status, stderr, left) in results.items():
        out = cases[name][0][2]
        if name.startswith("read-only"):
            expected = f"error: cannot write {out}: Read-only file system; write it to another folder {FIX}"
        else:
            expected = f"error: cannot write {out}: "
            assert "No space left on device" in stderr or "a write came out short" in stderr, (name, stderr)
            assert f"free on the disk holding {full}); free space there or write it to another folder {FIX}" in stderr
        assert_one_error_line(status, stderr, expected)
        assert left == [], (name, left)
