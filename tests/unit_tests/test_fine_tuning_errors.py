"""The fine-tuning features' rarer mistakes, each one line, in this process: chat templates that
cannot be read or rendered without jinja2, tokenizer files that cannot be read, data lines of
conversations that are not JSON or not UTF-8, LoRA checkpoints whose base is gone or does not fit,
and the scripts' own failures (the chat tokenizer's builder, the SFT benchmark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan.config.manager import parse_args
from torchtitan.datasets import chat
from torchtitan.datasets.sources import BadLineCounter, read_jsonl
from torchtitan.errors import CheckpointError, DatasetError, UserError

pytestmark = pytest.mark.fast


def test_template_files_that_are_missing_or_empty(tmp_path):
    with pytest.raises(chat.ChatError, match="is not a file"):
        chat.read_template(str(tmp_path / "none.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(chat.ChatError, match="is empty"):
        chat.read_template(str(tmp_path / "empty.jinja"))


def test_templates_without_jinja2_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)  # its import fails, as on a machine without it
    with pytest.raises(chat.ChatError, match=r"chat templates need jinja2: pip install 'torchtitan\[tokenizers\]'"):
        chat.ChatTemplate("{{ 'only here' }}", {}, "t")


def test_tokenizer_files_that_cannot_be_read(tmp_path):
    from torchtitan.datasets.hf_tokenizer import HFTokenizer
    from torchtitan.datasets.tokenizer_base import TokenizerError

    with pytest.raises(TokenizerError, match="is a folder without tokenizer.json"):
        HFTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="cannot read .*gone.json: No such file"):
        HFTokenizer(str(tmp_path / "gone.json"))


def test_conversation_lines_that_are_not_json_or_not_utf8(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b'{"messages": []}\n\xff\xfe not utf-8\n{not json\n')
    lines = list(read_jsonl(path, 0, path.stat().st_size, BadLineCounter(skip_bad_lines=True), parse=lambda x: x))
    assert lines == [({"messages": []}, 0)]
    with pytest.raises(DatasetError, match="chat.jsonl:2: invalid UTF-8 at byte 0 of the line"):
        list(read_jsonl(path, 0, path.stat().st_size, BadLineCounter(), parse=lambda x: x))
    path.write_bytes(b'{not json\n')
    with pytest.raises(DatasetError, match="chat.jsonl:1: not valid JSON"):
        list(read_jsonl(path, 0, path.stat().st_size, BadLineCounter(), parse=lambda x: x))


def test_prompt_completion_needs_an_end_of_text_token():
    from torchtitan.datasets.sft import conversation_encoder

    config = parse_args(["--sft.format", "prompt_completion"])
    with pytest.raises(DatasetError, match="ends each completion with the end-of-text token"):
        conversation_encoder(config, SimpleNamespace(eos_id=-1, path="t.json"))


def test_lora_checkpoints_whose_base_is_gone_or_that_start_a_run_without_lora(tmp_path):
    from torchtitan.checkpoint import lora, lora_export
    from torchtitan.checkpoint.resume import ResumePoint

    record = {"rank": 4, "alpha": 16.0, "adapters_only": True, "base": str(tmp_path / "gone")}
    manifest = SimpleNamespace(lora=record, model={"name": "llama3"})
    with pytest.raises(CheckpointError, match=r"the base model '.*gone' of checkpoint ckpt does not exist; pass --base"):
        lora_export.read_adapters("ckpt", manifest, None)
    whole = SimpleNamespace(lora={**record, "adapters_only": False})
    with pytest.raises(CheckpointError, match=r"holds a model with LoRA adapters \(rank 4\); merge its adapters"):
        lora.loads_for(ResumePoint("ckpt", True, whole), parse_args([]))


def test_generation_refuses_a_base_that_does_not_fit_the_model(monkeypatch):
    from scripts import generate
    from torchtitan.checkpoint import lora_export
    from torchtitan.checkpoint.states import ModelState

    model = torch.nn.Linear(2, 3)
    source = generate.Source("ckpt", False, "llama3", None, None, {"rank": 1, "alpha": 1.0})
    monkeypatch.setattr(generate.Manifest, "read", staticmethod(lambda path: None))
    monkeypatch.setattr(lora_export, "read_adapters", lambda *args: ({}, {}))
    for base, expected in (({}, "the base model of ckpt has no weight"),
                           ({"weight": torch.zeros(3, 5), "bias": torch.zeros(3)}, r"weight is \[3, 5\] there, \[3, 2\]")):
        monkeypatch.setattr(lora_export, "merged", lambda weights, adapters, record, where, base=base: base)
        with pytest.raises(generate.GenerateError, match=expected):
            generate._load_lora_merged(source, ModelState([model]), None)


def test_the_chat_tokenizer_builder_says_what_it_cannot_read_or_write(monkeypatch, tmp_path, capsys):
    from scripts import build_chat_tokenizer as builder

    monkeypatch.setattr(builder, "read_texts", lambda corpus: (_ for _ in ()).throw(DatasetError("corpus unreadable")))
    assert builder.main(["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "error: corpus unreadable"
    monkeypatch.setattr(builder, "read_texts", lambda corpus: iter(["a b c"]))
    monkeypatch.setattr(builder, "build_tokenizer_json", lambda texts: "{}")
    monkeypatch.setattr(builder, "tokenizer_config", lambda tokenizer_json: {})
    (tmp_path / "file").write_text("")
    assert builder.main(["--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write --out {tmp_path / 'file'}: ")


def test_the_benchmark_stops_with_the_generation_failure(monkeypatch, tmp_path):
    from scripts import sft_benchmark

    failed = subprocess.CompletedProcess([], 2, "", "warning: x\nerror: the tokenizer is gone\n")
    monkeypatch.setattr(sft_benchmark.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(SystemExit, match="generation failed for ckpt: error: the tokenizer is gone"):
        sft_benchmark.answers(Path("ckpt"), ["Reverse: a b"], tmp_path)
    assert isinstance(DatasetError("x"), UserError)
