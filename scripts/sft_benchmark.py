#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Fine-tuning as a capability: does a model learn a task it cannot do before? (docs/fine_tuning.md)

  python scripts/sft_benchmark.py                      # base, full SFT and LoRA; prints the table
  python scripts/sft_benchmark.py --only sft --sft-steps 300 --workdir /tmp/bench

The task is reversing short word lists (torchtitan/tools/instruction_task.py): chat conversations
with the answers in assistant turns. A base model is first pre-trained from scratch on plain text
(the bundled stdlib_docs, tokenized by the bundled chat tokenizer), standing in for a converted
open model; it is then fine-tuned on the task's conversations (full SFT, and LoRA on the frozen
base), each starting from the base's checkpoint through checkpoint.initial_load_path. Each model
answers held-out requests (word lists no training conversation holds) with greedy decoding through
scripts/generate.py --chat, which stops at the template's end-of-turn token; an answer counts when
it equals the reversed list exactly. Everything runs on the CPU in a few minutes; the figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.tools import instruction_task  # noqa: E402
from torchtitan.tools.runs import read_metrics, run_trainer  # noqa: E402

TOKENIZER = "bundled:chat_tokenizer"
MODEL = ("--model.name", "llama3", "--model.tokenizer_path", TOKENIZER)
FLAVOR = ["debugmodel"]  # --flavor
COMMON = ("--training.seq_len", "128", "--training.batch_size", "8", "--metrics.log_freq", "50",
          "--activation_checkpoint.mode", "none", "--training.warmup_steps", "20", "--training.decay_type", "cosine",
          "--checkpoint.enable_checkpoint", "--checkpoint.interval", "100000")
# The base and full SFT save weights alone; a LoRA run saves its adapters (generate.py folds them into the base).
WEIGHTS_ONLY = ("--checkpoint.model_weights_only",)


def train(workdir: Path, name: str, steps: int, *args: str) -> tuple[Path, float, float]:
    """One run; its final checkpoint folder, its final loss and its wall time."""
    folder = workdir / name
    start = time.perf_counter()
    run_trainer([*MODEL, "--model.flavor", FLAVOR[0], *COMMON, "--training.steps", str(steps), "--job.dump_folder", str(folder), *args],
                timeout=3600)
    seconds = time.perf_counter() - start
    return folder / "checkpoint" / f"step-{steps}", read_metrics(folder)[-1]["loss"], seconds


def answers(checkpoint: Path, prompts: list[str], workdir: Path, *extra: str) -> list[str]:
    """Greedy answers of a checkpoint to user prompts, through scripts/generate.py --chat."""
    prompts_file = workdir / "prompts.txt"
    prompts_file.write_text("".join(p + "\n" for p in prompts))
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), "--checkpoint", str(checkpoint),
                             "--tokenizer", TOKENIZER, "--chat", "--prompts-file", str(prompts_file),
                             "--max-new-tokens", "24", *extra], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"generation failed for {checkpoint}: {last}")
    got = []
    for i, prompt in enumerate(prompts):
        line = next(x for x in result.stdout.splitlines() if x.startswith(f"[{i}] "))
        got.append(line[len(f"[{i}] {prompt}"):])
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--base-steps", type=int, default=300, help="pre-training steps of the base model")
    p.add_argument("--base", help="a base model's checkpoint (a step folder of an earlier run's base) instead of "
                                  "pre-training one")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--lora-steps", type=int, default=800, help="LoRA learns the task more slowly than full SFT")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--held-out", type=int, default=200, help="held-out requests answered by each model")
    p.add_argument("--flavor", default=FLAVOR[0], help="the llama3 flavor of the base model")
    p.add_argument("--only", choices=["sft", "lora"], help="fine-tune one way only")
    p.add_argument("--json", help="also write the figures to this file")
    ns = p.parse_args()
    FLAVOR[0] = ns.flavor
    workdir = Path(ns.workdir or tempfile.mkdtemp(prefix="sft_benchmark_"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "train.jsonl"
    train_set = instruction_task.write(data, 2000, seed=0)
    held = instruction_task.held_out(ns.held_out, seed=1, train=train_set)
    prompts, expected = [m[0]["content"] for m, _ in held], [a for _, a in held]

    rows = []
    if ns.base:
        base, base_loss, base_s = Path(ns.base), float("nan"), 0.0
    else:
        base, base_loss, base_s = train(workdir, "base", ns.base_steps, *WEIGHTS_ONLY, "--optimizer.lr", "2e-3")
    rows.append(("base (pre-trained on text)", base_loss, base_s, instruction_task.exact_match(
        answers(base, prompts, workdir), expected)))
    sft = ("--sft.format", "chat", "--training.dataset_path", str(data), "--training.document_mask",
           "--checkpoint.initial_load_path", str(base), "--training.dataset_shuffle")
    if ns.only in (None, "sft"):
        tuned, loss, seconds = train(workdir, "sft", ns.sft_steps, *sft, *WEIGHTS_ONLY, "--optimizer.lr", "1e-3")
        rows.append((f"full SFT, {ns.sft_steps} steps", loss, seconds,
                     instruction_task.exact_match(answers(tuned, prompts, workdir), expected)))
    if ns.only in (None, "lora"):
        tuned, loss, seconds = train(workdir, "lora", ns.lora_steps, *sft, "--optimizer.lr", str(ns.lora_lr),
                                     "--optimizer.weight_decay", "0", "--lora.rank", str(ns.lora_rank),
                                     "--lora.alpha", str(2 * ns.lora_rank))
        rows.append((f"LoRA rank {ns.lora_rank}, {ns.lora_steps} steps", loss, seconds,
                     instruction_task.exact_match(answers(tuned, prompts, workdir), expected)))
    print(f"\nreverse-words task, {len(prompts)} held-out requests, llama3 {ns.flavor}, chat tokenizer ({workdir})\n")
    print("| model | final training loss | wall s | exact match |")
    print("| --- | ---: | ---: | ---: |")
    for name, loss, seconds, accuracy in rows:
        print(f"| {name} | {loss:.3f} | {seconds:.0f} | {accuracy:.1%} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps([dict(zip(("model", "loss", "seconds", "exact_match"), r)) for r in rows],
                                            indent=1))


if __name__ == "__main__":
    main()
