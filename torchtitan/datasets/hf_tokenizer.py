"""Hugging Face `tokenizer.json` tokenizers (Qwen, DeepSeek-V3, Llama 3 from the hub), read with the
`tokenizers` library (the optional extra `torchtitan[tokenizers]`).

`model.tokenizer_path` names either a `tokenizer.json` file, read alone, or a folder holding one,
where the files beside it count too: `tokenizer_config.json` (the special tokens' roles, the chat
template), `special_tokens_map.json` (roles the config leaves out) and `chat_template.jinja` (the
template, preferred over the config's, as transformers does). `generation_config.json` travels
with a converted folder but is not read here: its end-of-turn ids steer generation, not training.

Token ids equal `transformers.AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)`:
special-token text inside `text` (`<|im_end|>`) becomes the special token, as there. The BOS and
EOS this class adds are its own `bos_id`/`eos_id`, chosen by `special_token_roles` below.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from torchtitan.datasets.tokenizer_base import Tokenizer, TokenizerError

logger = logging.getLogger("torchtitan")

TOKENIZER_JSON = "tokenizer.json"
# The files of a Hugging Face folder that make up its tokenizer: what a conversion or an export
# carries along, in this order.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
ROLES = ("bos", "eos", "pad")
# Names that, among a tokenizer's special tokens, mean a role: used only where neither the
# config files nor the post-processor's template say (e.g. Llama 3's tokenizer.json alone).
_WELL_KNOWN = {
    "bos": ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<bos>", "<|startoftext|>"),
    "eos": ("<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>", "<|endoftext|>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<｜▁pad▁｜>"),
}


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` (or a folder holding one), with the special tokens' roles from its config.

    Attributes: `n_words` (the largest id + 1, added tokens included), `bos_id`, `eos_id`, `pad_id`
    (-1 where there is none), `path` (the tokenizer.json), `folder` (the folder named, or None for a
    file named alone), `config` (tokenizer_config.json, {} without one), `chat_template` (or None),
    `special_tokens` (the added tokens marked special: text -> id).

    Picklable: the data loader's worker processes get a copy (the `tokenizers` object pickles as
    its JSON, so a worker never reads the file again)."""

    def __init__(self, path: str):
        tokenizers = _import_tokenizers()
        if os.path.isdir(path):
            self.folder: str | None = path
            self.path = os.path.join(path, TOKENIZER_JSON)
            if not os.path.isfile(self.path):
                raise TokenizerError(f"{path} is a folder without {TOKENIZER_JSON}")
        else:
            self.folder, self.path = None, path
            if os.path.isfile(os.path.join(os.path.dirname(path) or ".", "tokenizer_config.json")):
                logger.warning(f"notice: {path} is read alone; name its folder to use the tokenizer_config.json "
                               "beside it (the special tokens' roles, the chat template)")
        raw = _read_bytes(self.path)
        spec = _parse_json(raw, self.path)
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerError(f"{self.path} is not a Hugging Face tokenizer.json: it has no \"model\" entry")
        try:
            self.model = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises plain Exception with its own message
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{self.path} is not a tokenizer.json the tokenizers library reads: {reason}") from None
        # transformers turns off a file's own truncation and padding unless a call asks for them;
        # left on, they would cut or pad every document here.
        self.model.no_truncation()
        self.model.no_padding()

        self.config = self._read_folder_json("tokenizer_config.json")
        special_map = self._read_folder_json("special_tokens_map.json")
        vocab = self.model.get_vocab(with_added_tokens=True)
        self.n_words = max(vocab.values()) + 1
        self.special_tokens = {t.content: i for i, t in sorted(self.model.get_added_tokens_decoder().items())
                               if t.special}
        self.role_tokens = special_token_roles(self.config, special_map, spec, self.special_tokens)
        for role, token in self.role_tokens.items():
            if token is not None and token not in vocab:
                raise TokenizerError(f"{self.folder or self.path}: its {role}_token {token!r} is not a token of "
                                     f"{self.path}")
        self.bos_id, self.eos_id, self.pad_id = (vocab[t] if t is not None else -1 for t in self.role_tokens.values())
        self.chat_template = self._read_chat_template()
        # transformers 5's decode: the clean-up of spaces a config asks for, except for BPE models
        # (where it would strip real spaces) unless the config insists.
        self._clean_up_spaces = self.config.get("clean_up_tokenization_spaces") is True and (
            spec["model"].get("type") != "BPE"
            or self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") is True)
        # Hashed now: the file may change or vanish during a long run, and workers never read it.
        digest = hashlib.sha256(raw)
        for role, token in self.role_tokens.items():
            digest.update(f"\n{role}_token={token if token is not None else ''}".encode())
        self._sha256 = digest.hexdigest()

    def fingerprint(self) -> str:
        """The sha256 of tokenizer.json's bytes and the bos/eos/pad token strings: the same file with
        other roles (an EOS after every document) makes other token streams."""
        return self._sha256

    def files(self) -> dict[str, str]:
        """The tokenizer's files, by the names a Hugging Face folder gives them: those of
        TOKENIZER_FILES the folder holds, or the tokenizer.json named alone."""
        if self.folder is None:
            return {TOKENIZER_JSON: self.path}
        return {name: os.path.join(self.folder, name) for name in TOKENIZER_FILES
                if os.path.isfile(os.path.join(self.folder, name))}

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (a special token's name, or a vocabulary entry); None if none."""
        return self.model.token_to_id(text)

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """transformers' ids for `text` (special-token text parsed as the special token), with BOS
        first when `bos` and the tokenizer has one, and EOS last when `eos` and it has one."""
        ids = self.model.encode(text, add_special_tokens=False).ids
        if bos and self.bos_id >= 0:
            ids.insert(0, self.bos_id)
        if eos and self.eos_id >= 0:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `encode(text, bos=False, eos=False)` and each token's (start, end) character
        span in `text` (Python string indices, not bytes). Two quirks of byte-level BPE and
        normalizers: a character whose bytes fall into several tokens gives each of them that
        character's whole span (spans overlap, e.g. an emoji split in two); and under a normalizer
        that composes characters (Qwen's NFC), a composed character's span is the first of the
        characters it came from, so a combining mark may lie in no token's span."""
        encoding = self.model.encode(text, add_special_tokens=False)
        return encoding.ids, list(encoding.offsets)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included, as transformers' `decode(ids)` gives it."""
        text = self.model.decode(list(ids), skip_special_tokens=False)
        return _clean_up_tokenization_spaces(text) if self._clean_up_spaces else text

    def _read_folder_json(self, name: str) -> dict[str, Any]:
        """A JSON object file of the folder; {} when there is no folder or no such file."""
        if self.folder is None or not os.path.isfile(os.path.join(self.folder, name)):
            return {}
        path = os.path.join(self.folder, name)
        value = _parse_json(_read_bytes(path), path)
        if not isinstance(value, dict):
            raise TokenizerError(f"{path} is not a JSON object")
        return value

    def _read_chat_template(self) -> str | None:
        """chat_template.jinja if the folder has one (transformers prefers it), else the config's:
        a string, or a list of named templates of which "default" is the one."""
        if self.folder is not None and os.path.isfile(os.path.join(self.folder, "chat_template.jinja")):
            return _read_bytes(os.path.join(self.folder, "chat_template.jinja")).decode("utf-8", errors="replace")
        template = self.config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        return template if isinstance(template, str) else None


def special_token_roles(config: dict[str, Any], special_map: dict[str, Any], spec: dict[str, Any],
                        special_tokens: dict[str, int]) -> dict[str, str | None]:
    """The bos/eos/pad token strings, each from the first source that names the role:
    1. tokenizer_config.json's `<role>_token` (a string, or a {"content": ...} object; null: none);
    2. special_tokens_map.json's, the same way;
    3. for bos and eos, the post-processor's template (the special token before, and after, the
       text in its "single" template, as a tokenizer.json that adds them itself declares them);
    4. a well-known name among the special tokens (`<|begin_of_text|>`, `<s>`, `<|end_of_text|>`,
       `</s>`, `<|endoftext|>`, `<pad>`, ...); else none."""
    template = _template_tokens(spec.get("post_processor"))
    roles: dict[str, str | None] = {}
    for role in ROLES:
        key = f"{role}_token"
        if key in config:
            roles[role] = _token_text(config[key])
        elif key in special_map:
            roles[role] = _token_text(special_map[key])
        elif template.get(role) is not None:
            roles[role] = template[role]
        else:
            roles[role] = next((name for name in _WELL_KNOWN[role] if name in special_tokens), None)
    return roles


def _token_text(value: Any) -> str | None:
    """A config's token entry: "<s>", {"content": "<s>", ...} (transformers' AddedToken), or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_tokens(processor: Any) -> dict[str, str]:
    """bos/eos from a TemplateProcessing post-processor (or one inside a Sequence): the special
    tokens its "single" template puts before and after the text."""
    if not isinstance(processor, dict):
        return {}
    if processor.get("type") == "Sequence":
        for inner in processor.get("processors") or []:
            found = _template_tokens(inner)
            if found:
                return found
        return {}
    if processor.get("type") != "TemplateProcessing":
        return {}
    pieces = processor.get("single") or []
    kinds = [next(iter(p)) if isinstance(p, dict) and p else None for p in pieces]
    if "Sequence" not in kinds:
        return {}
    text_at = kinds.index("Sequence")
    found = {}
    if text_at > 0 and kinds[0] == "SpecialToken":
        found["bos"] = pieces[0]["SpecialToken"].get("id")
    if text_at < len(pieces) - 1 and kinds[-1] == "SpecialToken":
        found["eos"] = pieces[-1]["SpecialToken"].get("id")
    return {k: v for k, v in found.items() if isinstance(v, str)}


def _clean_up_tokenization_spaces(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and English contractions, applied by its
    decode where tokenizer_config.json sets clean_up_tokenization_spaces (BERT-era configs)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("a Hugging Face tokenizer.json needs the tokenizers package: "
                             "pip install 'torchtitan[tokenizers]'") from None
    return tokenizers


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror or e}") from None


def _parse_json(raw: bytes, path: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))  # not json.loads(raw), which also takes UTF-16 and -32
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def is_hf_tokenizer(path: str) -> bool:
    """Whether `path` is meant as a Hugging Face tokenizer: a folder holding tokenizer.json, a
    `.json` file, or a file whose first non-blank byte opens a JSON object (tiktoken rank files
    start with base64, sentencepiece models with a protobuf tag)."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, TOKENIZER_JSON))
    if path.endswith(".json"):
        return True
    with open(path, "rb") as f:
        return f.read(256).lstrip()[:1] == b"{"
