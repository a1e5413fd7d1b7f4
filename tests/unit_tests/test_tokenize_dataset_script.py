"""scripts/tokenize_dataset.py's mistakes (issue 37): each is one `error:` line on stderr and exit
status 2, with nothing written where the shards would have gone and the input left as it was."""

import json

import pytest

from scripts.tokenize_dataset import main
from torchtitan.datasets.tokenized import MANIFEST


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A text folder `web` of two files, and a plain file, in a working folder of their own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "web").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "web" / name).write_text("".join(json.dumps({"text": f"{name} document {i}"}) + "\n"
                                                     for i in range(5)))
    (tmp_path / "notes.txt").write_text("a plain file\n")
    return tmp_path


def _files(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _refused(capsys, root, *argv: str) -> str:
    """Runs the script; asserts exit 2, one `error:` line and no file changed. Returns the line."""
    before = _files(root)
    code = main([*argv, "--workers", "1", "--quiet"] if "--workers" not in argv else [*argv, "--quiet"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, captured.err)
    assert "Traceback" not in captured.out + captured.err and not captured.out
    assert _files(root) == before
    return lines[0]


def test_an_out_that_is_a_file(data, capsys):
    line = _refused(capsys, data, "--input", "web", "--out", "notes.txt")
    assert line == "error: --out notes.txt is a file; name a folder for the shards (it is created if missing)"


def test_an_out_below_a_file(data, capsys):
    line = _refused(capsys, data, "--input", "web", "--out", "notes.txt/tokens")
    assert line == "error: cannot write --out notes.txt/tokens: Not a directory (notes.txt/tokens)"


def test_a_full_disk_in_an_existing_out_folder(data, capsys, monkeypatch):
    from torchtitan.datasets import tokenized

    def full(self, ids):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenized.TokenFileWriter, "add", full)  # the forked workers inherit it
    (data / "tokens").mkdir()
    line = _refused(capsys, data, "--input", "web", "--out", "tokens")
    assert line == ("error: cannot write --out tokens: No space left on device (a part file); the folder holds no "
                    "manifest, so no run reads it")


@pytest.mark.parametrize("parts", ["0", "-2"])
def test_parts_below_one(data, capsys, parts):
    line = _refused(capsys, data, "--input", "web", "--out", "tokens", "--parts", parts)
    assert line == f"error: --parts must be at least 1, got {parts} (leave it out for one part per 512 MB of input)"


def test_workers_below_one(data, capsys):
    line = _refused(capsys, data, "--input", "web", "--out", "tokens", "--workers", "0")
    assert line == "error: --workers must be at least 1, got 0"


@pytest.mark.parametrize("argv,expected", [
    (["--input", "web"], "error: the following arguments are required: --out (see tokenize_dataset.py --help)"),
    (["--input", "web", "--out", "t", "--parts", "two"],
     "error: argument --parts: invalid int value: 'two' (see tokenize_dataset.py --help)"),
    (["--input", "web", "--out", "t", "--shards", "2"],
     "error: unrecognized arguments: --shards 2 (see tokenize_dataset.py --help)"),
])
def test_command_line_mistakes(data, capsys, argv, expected):
    assert _refused(capsys, data, *argv) == expected


def test_out_is_the_input_folder(data, capsys):
    line = _refused(capsys, data, "--input", "web", "--out", "web")
    assert line == ("error: --out web is the input folder: its manifest would make a run given that folder read the "
                    "token shards instead of the text; write the shards beside it (e.g. --out web-tokens)")


def test_out_is_a_link_to_the_input_folder(data, capsys):
    (data / "link").symlink_to(data / "web")
    line = _refused(capsys, data, "--input", "web/", "--out", "link")
    assert line.startswith("error: --out link is the input folder: its manifest would make a run given that folder")


@pytest.mark.parametrize("given", ["web", "web/*.jsonl", "web/**/*.jsonl"])
def test_out_inside_the_input_folder(data, capsys, given):
    line = _refused(capsys, data, "--input", given, "--out", "web/tokens")
    assert line == "error: --out web/tokens is inside the input folder web; write the shards beside it (e.g. --out web-tokens)"


@pytest.mark.parametrize("out", [".", "web"])
def test_out_holding_the_input_file(data, capsys, out):
    # A run given that folder would read the manifest's shards and no longer the text in it.
    line = _refused(capsys, data, "--input", "web/a.jsonl", "--out", out)
    assert line == (f"error: --out {out} holds the input web/a.jsonl: a run given that folder would then read the "
                    "token shards instead of its text; choose an --out outside the input")


def test_a_folder_beside_the_input_file_is_fine(data, capsys):
    assert main(["--input", "web/a.jsonl", "--out", "web-a", "--workers", "1", "--quiet"]) == 0
    assert (data / "web-a" / MANIFEST).is_file()
    # A sibling folder inside the file's folder is not the input folder: only that file is read.
    assert main(["--input", "web/a.jsonl", "--out", "web/a-tokens", "--workers", "1", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_existing_shards_and_tokenized_input(data, capsys):
    assert main(["--input", "web", "--out", "tokens", "--workers", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert _refused(capsys, data, "--input", "web", "--out", "tokens") == (
        "error: tokens already holds tokenized shards (manifest.json); choose another folder or pass --overwrite")
    assert _refused(capsys, data, "--input", "tokens", "--out", "again") == (
        "error: tokens is already a folder of token shards; give --input the text they came from")


def test_input_mistakes(data, capsys):
    assert _refused(capsys, data, "--input", "nowhere", "--out", "t") == "error: dataset file not found: nowhere"
    assert _refused(capsys, data, "--input", "bundled:nope.jsonl", "--out", "t").startswith(
        "error: --input 'bundled:nope.jsonl': the torchtitan package ships no such file")
    assert _refused(capsys, data, "--input", "web", "--out", "t", "--tokenizer", "no.model") == (
        "error: tokenizer file not found: no.model (set --tokenizer)")


def test_a_hub_stream_is_refused_before_anything_is_written(data, capsys):
    assert _refused(capsys, data, "--input", "c4", "--out", "t") == (
        "error: allenai/c4 is a hub stream; tokenize_dataset reads local files (.jsonl, .txt, .parquet)")


def test_a_bad_line_names_this_scripts_option(data, capsys):
    (data / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    line = _refused(capsys, data, "--input", "bad.jsonl", "--out", "t")
    assert line == "error: bad.jsonl:2: not a JSON object with a 'text' field (set --skip-bad-lines to skip such lines)"


def test_an_unreadable_input_file(data, capsys, monkeypatch):
    from torchtitan.datasets import sources

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sources, "read_jsonl", denied)  # the forked workers inherit it (tests run as root)
    line = _refused(capsys, data, "--input", "web", "--out", "t")
    assert line == "error: cannot read web/a.jsonl: Permission denied"

