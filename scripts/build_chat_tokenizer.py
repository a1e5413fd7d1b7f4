#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Builds the bundled chat tokenizer, `torchtitan/assets/chat_tokenizer/`, from the bundled corpus.

A Hugging Face `tokenizer.json` small enough for the tiny test models (1,024 ids: 256 byte tokens,
765 merges, 3 special tokens), shaped like Qwen2.5's: byte-level BPE, ChatML special tokens placed
after the base vocabulary, and a `tokenizer_config.json` with EOS `<|im_end|>`, pad `<|endoftext|>`,
no BOS and a ChatML chat template. Running it again gives byte-identical files.

    .venv/bin/python scripts/build_chat_tokenizer.py [--out torchtitan/assets/chat_tokenizer]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's torchtitan, also where it is not installed

from scripts.train_tiktoken_bpe import read_texts  # noqa: E402 - after the path above
from torchtitan.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "torchtitan/assets/stdlib_docs/corpus.jsonl"
VOCAB_SIZE = 1024
# Qwen's order: the end-of-text (document separator, here also the pad) first, then the ChatML markers.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's ChatML template without its default system message and tool calls: every message as
# `<|im_start|>{role}\n{content}<|im_end|>\n`, then the assistant's header when a reply is wanted.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer_json(texts: list[str]) -> str:
    """The trained tokenizer, serialised as `tokenizer.json` text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # GPT-2's byte-level scheme (as Qwen's): the regex split, then bytes mapped to printable
    # characters, so every string has an encoding and no id means "unknown".
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Offsets of the untrimmed pieces: a token's span then covers its leading space, which is
    # what the chat code's assistant-turn masks want (as Qwen's trim_offsets=false).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)  # deterministic, whatever its thread count
    # Added after training, so that they take the last ids, after the base vocabulary (as Qwen's).
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer.to_str(pretty=True) + "\n"


def tokenizer_config(tokenizer_json: str) -> dict:
    """`tokenizer_config.json`: the special tokens' roles, in the layout `transformers` writes."""
    added = json.loads(tokenizer_json)["added_tokens"]
    return {
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in added
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def main(argv: list[str] | None = None) -> int:
    """Writes `tokenizer.json` and `tokenizer_config.json` under --out; a mistake is one line, exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "torchtitan/assets/chat_tokenizer",
                        help="the folder to write (created if missing)")
    args = parser.parse_args(argv)
    try:
        texts = list(read_texts(CORPUS))
    except UserError as e:
        print(e.line, file=sys.stderr)
        return 2
    tokenizer_json = build_tokenizer_json(texts)
    config = json.dumps(tokenizer_config(tokenizer_json), indent=2, ensure_ascii=False) + "\n"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (args.out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    except OSError as e:
        print(f"error: cannot write --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/tokenizer.json ({VOCAB_SIZE} ids) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
