"""A synthetic instruction task for fine-tuning checks: reverse a short list of words.

A model cannot do it before it is fine-tuned on it (the answer is no continuation of text it has
seen), and whether it can afterwards is an exact match, so the task measures a capability, not a
loss. Conversations are chat lines (`{"messages": [...]}`, sft.format chat); some carry a system
message and some hold two requests, so the training data exercises multi-turn masks too. The
held-out set is drawn with another seed and shares no word list with the training set.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ("apple", "river", "stone", "cloud", "green", "light", "music", "paper", "table", "water", "house", "dream",
         "north", "south", "train", "glass", "plant", "smile", "bread", "chair", "ocean", "tiger", "horse", "night",
         "storm", "sugar", "piano", "lemon", "brick", "grape", "flame", "wheel")
SYSTEM = "You reverse lists of words."


def request(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return f"Reverse: {' '.join(words)}", " ".join(reversed(words))


def conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.3 else 1):
        question, answer = request(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def write(path: Path, count: int, seed: int, exclude: set[str] | None = None) -> list[list[dict[str, str]]]:
    """`count` conversations as chat lines in `path`; requests in `exclude` are drawn again."""
    rng, conversations = random.Random(seed), []
    while len(conversations) < count:
        messages = conversation(rng)
        if exclude and any(m["content"] in exclude for m in messages if m["role"] == "user"):
            continue
        conversations.append(messages)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    return conversations


def held_out(count: int, seed: int, train: list[list[dict[str, str]]]) -> list[tuple[list[dict[str, str]], str]]:
    """(prompt messages, expected answer) pairs whose requests training never saw."""
    seen = {m["content"] for messages in train for m in messages if m["role"] == "user"}
    rng, pairs = random.Random(seed), []
    while len(pairs) < count:
        question, answer = request(rng)
        if question not in seen:
            seen.add(question)
            pairs.append(([{"role": "user", "content": question}], answer))
    return pairs


def exact_match(answers: list[str], expected: list[str]) -> float:
    return sum(a.strip() == e for a, e in zip(answers, expected)) / max(len(expected), 1)


def summary(name: str, accuracy: float, count: int, **extra: Any) -> str:
    more = "".join(f", {k} {v}" for k, v in extra.items())
    return f"{name}: exact match {accuracy:.1%} of {count} held-out requests{more}"
