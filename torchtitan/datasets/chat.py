"""Conversations -> token ids and the tokens that carry loss (supervised fine-tuning).

A chat line `{"messages": [{"role": ..., "content": ...}, ...]}` is rendered with a Jinja chat
template the way `transformers`' `apply_chat_template` renders it (the same sandbox, filters and
globals, the tokenizer's special tokens as variables), then tokenized whole, so its ids are those
`apply_chat_template(..., tokenize=True)` gives. The assistant turns are found in the rendered text
by rendering the conversation up to each turn (with and without the generation prompt) and taking
the text the turn adds: its content and the template's end-of-turn marker, which is what the model
must learn to produce. Tokens whose first character lies in such a span are targets.

A prompt/completion line is plain text: the prompt's ids, then the completion's and the end-of-text
token, the completion and that token being the targets.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any

from torchtitan.errors import DatasetError

ROLES = ("system", "user", "assistant")
# Role names some datasets use for the same turns; read as these.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}


class ChatError(DatasetError):
    """A conversation or a chat template that cannot be used; one line naming what."""


def read_template(path: str) -> str:
    """A chat template file's text (sft.chat_template)."""
    if not os.path.isfile(path):
        raise ChatError(f"sft.chat_template {path} is not a file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ChatError(f"sft.chat_template {path} is empty")
    return text


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """A template compiled in the sandbox `transformers` uses, with its helpers: templates from the
    hub are untrusted code, and the same environment renders them the same way."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatError("chat templates need jinja2: pip install 'torchtitan[tokenizers]'") from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text in some templates; the span is
        found by rendering prefixes here, so the block renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatError(f"the chat template does not parse: {e.message} (line {e.lineno} of the template)") from None


def special_token_variables(tokenizer: Any) -> dict[str, Any]:
    """What `transformers` hands a template besides the messages: the special tokens' text."""
    config = getattr(tokenizer, "config", None) or {}
    names = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            names[key] = value
    extra = config.get("additional_special_tokens")
    if extra:
        names["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return names


class ChatTemplate:
    """Renders conversations with one template; picklable (worker processes compile it again)."""

    def __init__(self, source: str, variables: dict[str, Any], where: str, special_texts: tuple[str, ...] = ()):
        self.source, self.variables, self.where = source, variables, where
        self.special_texts = special_texts  # the tokenizer's special tokens, as text
        try:
            _compile(source)  # a template that does not parse is refused when the data is built
        except ChatError as e:
            raise ChatError(f"{where}: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return _compile(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                tools=None, documents=None, **self.variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template ({self.where}) does not render this conversation: "
                            f"{getattr(e, 'message', None) or e}") from None
        except Exception as e:  # noqa: BLE001 - a template is code: whatever it raises is the conversation's problem
            raise ChatError(f"the chat template ({self.where}) does not render this conversation: "
                            f"{type(e).__name__}: {e}") from None


def chat_template_for(tokenizer: Any, template_path: str = "") -> ChatTemplate:
    """sft.chat_template's file, else the tokenizer's own template; one line when there is none.
    Conversations are tokenized whole and their turns found by character offsets, which only a
    Hugging Face tokenizer gives (tiktoken and sentencepiece files carry no template either)."""
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise ChatError(f"chat data needs a Hugging Face tokenizer (a tokenizer.json, or the folder holding it with "
                        f"its tokenizer_config.json) in model.tokenizer_path, not {tokenizer.path}")
    special = tuple(getattr(tokenizer, "special_tokens", {}))
    if template_path:
        from torchtitan.assets import resolve_path

        path = resolve_path(template_path, "sft.chat_template", ChatError)
        return ChatTemplate(read_template(path), special_token_variables(tokenizer), template_path, special)
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise ChatError(f"tokenizer {tokenizer.path} has no chat template (a tokenizer_config.json with "
                        "chat_template beside its tokenizer.json); name a template file with sft.chat_template")
    return ChatTemplate(own, special_token_variables(tokenizer), f"the chat_template of {tokenizer.path}", special)


def check_messages(record: Any) -> list[dict[str, str]]:
    """A chat line's messages, checked: roles known, contents strings, at least one assistant turn.
    Raises ValueError with the reason (the reader names the file and line)."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError("not a JSON object with a 'messages' list (sft.format chat)")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' is not a non-empty list")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} is not an object with 'role' and 'content'")
        role = _ROLE_ALIASES.get(message["role"], message["role"])
        if role not in ROLES:
            raise ValueError(f"message {i} has the unknown role {message['role']!r} (known: {', '.join(ROLES)})")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {i}'s content is {type(message['content']).__name__}, not a string")
        if role == "assistant" and not message["content"].strip():
            raise ValueError(f"message {i} is an empty assistant turn, so nothing to train on in it")
        checked.append({**message, "role": role})
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError("the conversation has no assistant turn, so nothing to train on")
    return checked


def check_prompt_completion(record: Any) -> tuple[str, str]:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
            or not isinstance(record.get("completion"), str):
        raise ValueError("not a JSON object with 'prompt' and 'completion' strings (sft.format prompt_completion)")
    if not record["completion"]:
        raise ValueError("the completion is empty, so nothing to train on")
    return record["prompt"], record["completion"]


def turn_closer(template: ChatTemplate) -> str:
    """What the template renders after an assistant turn's content (`<|im_end|>\n`, `<|eot_id|>`, ...):
    the end of a turn the model must learn to produce, found by rendering one."""
    text = template.render([{"role": "user", "content": "Q"}, {"role": "assistant", "content": _PROBE}])
    return text[text.rfind(_PROBE) + len(_PROBE):]


_PROBE = "A7c3ProbeAnswer"


def assistant_spans(template: ChatTemplate, messages: list[dict[str, str]], text: str,
                    closer: str) -> list[tuple[int, int]]:
    """The character spans of `text` (the whole conversation rendered) that the assistant turns
    add: from the end of the conversation before the turn rendered with the generation prompt,
    through the turn rendered alone (where the whole text starts with it), else through the turn's
    content and the template's turn `closer` found right after it (a template that renders a turn
    otherwise once more follow, Qwen3's thinking block). A turn that cannot be located this way is
    refused (ValueError): searching the text for the content could find it in a user's turn."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        if not text.startswith(before) or (spans and len(before) < spans[-1][1]):
            raise ValueError(f"the chat template renders the conversation before assistant turn {i} otherwise once "
                             "the turn follows, so its tokens cannot be told apart")
        start = len(before)
        through = template.render(messages[:i + 1])
        if text.startswith(through) and len(through) > start:
            spans.append((start, len(through)))
            continue
        found = text.find(message["content"], start)
        nearest_special = min((text.find(t, start) for t in template.special_texts if text.find(t, start) >= 0),
                              default=len(text))
        if found < 0 or found > nearest_special:  # the content must lie in this turn, before its closing token
            raise ValueError(f"the chat template does not show assistant turn {i}'s content where the turn is "
                             "rendered, so its tokens cannot be found")
        end = found + len(message["content"])
        if closer and text.startswith(closer, end):
            end += len(closer)
        else:
            closing = next((t for t in template.special_texts if closer.startswith(t)), "")
            end += len(closing) if closing and text.startswith(closing, end) else 0
        spans.append((start, end))
    return spans


class ConversationEncoder:
    """A checked JSON line -> (ids, targets): targets[j] is True where token j carries loss."""

    def __init__(self, tokenizer: Any, format: str, template: ChatTemplate | None = None):
        self.tokenizer, self.format, self.template = tokenizer, format, template
        self.closer = turn_closer(template) if template is not None else ""

    def check(self, record: Any) -> Any:
        return check_messages(record) if self.format == "chat" else check_prompt_completion(record)

    def __call__(self, checked: Any) -> tuple[list[int], list[bool]]:
        if self.format == "chat":
            return self.encode_chat(checked)
        return self.encode_prompt_completion(*checked)

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        text = self.template.render(messages)
        try:
            spans = assistant_spans(self.template, messages, text, self.closer)
        except ValueError as e:
            raise ChatError(f"{e} ({self.template.where})") from None
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        # A token is a target when its characters overlap a span: one that starts in the generation
        # prompt and runs into the answer (" hello" after "Assistant:") is the answer's first token.
        targets, s = [], 0
        for start, end in offsets:
            while s < len(spans) and start >= spans[s][1]:
                s += 1
            targets.append(s < len(spans) and end > spans[s][0])
        if ids:
            targets[0] = False  # a conversation's first token is never predicted from the one before it
        return ids, targets

    def encode_prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
        tokenizer = self.tokenizer
        head = tokenizer.encode(prompt, bos=tokenizer.bos_id >= 0, eos=False)
        tail = tokenizer.encode(completion, bos=False, eos=tokenizer.eos_id >= 0)
        targets = [False] * len(head) + [True] * len(tail)
        if targets:
            targets[0] = False
        return head + tail, targets


def end_of_turn_id(template: ChatTemplate, tokenizer: Any) -> int:
    """The token the template closes an assistant turn with, which generation stops at: the first
    special token the template renders after an answer (<|im_end|>, <|eot_id|>, ...); a template
    that closes turns with plain text only is refused."""
    closer = turn_closer(template)
    special = set(getattr(tokenizer, "special_tokens", {}).values())
    ids, _ = tokenizer.encode_with_offsets(closer)
    found = next((i for i in ids if i in special), None)
    if found is None:
        raise ChatError(f"the chat template ({template.where}) closes an assistant turn with {closer!r}, which holds no "
                        "special token, so an answer's end cannot be told; name a template that ends turns with one")
    return found


def generation_prompt(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ending with a user turn, rendered with the generation prompt and tokenized."""
    return tokenizer.encode_with_offsets(template.render(messages, add_generation_prompt=True))[0]
