#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""Generates text from a trained model: a checkpoint of this project or a Hugging Face folder.

  # the newest checkpoint of a run, greedy, one prompt streamed as it grows
  python scripts/generate.py --checkpoint outputs/checkpoint --prompt "The os module" --max-new-tokens 40

  # sampling, several prompts (printed when all are done), bfloat16 on a GPU
  python scripts/generate.py --checkpoint hf/Llama-3.2-1B --prompts-file prompts.txt \\
      --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1 --dtype bfloat16

  # tensor parallel over 2 ranks (each holds half of every layer's heads)
  torchrun --standalone --nproc_per_node 2 scripts/generate.py --checkpoint outputs/checkpoint --prompt "def"

  # a chat model: each prompt is a user turn rendered with the tokenizer's chat template, and the
  # answer ends at the template's end-of-turn token
  python scripts/generate.py --checkpoint hf/Qwen3-0.6B --chat --system "Be brief." --prompt "Reverse: a b c"

A LoRA run's checkpoint generates with its adapters folded into its base (the run's
checkpoint.initial_load_path, or --base). `--checkpoint` takes a `step-N` folder (a full training checkpoint or a weights-only one), a run's
checkpoint folder (its newest complete step), or a Hugging Face folder (config.json and safetensors;
its tokenizer.json folder or tokenizer.model is used unless --tokenizer names another). Generation uses a KV cache
(torchtitan/inference/generation.py); --no-kv-cache re-runs the whole sequence at every step instead. A
mistake prints one `error:` line and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan.assets import resolve_path
from torchtitan.checkpoint import folders, hf_folder
from torchtitan.checkpoint.folders import Manifest
from torchtitan.checkpoint.hf_training import is_hf_folder, load_hf_weights, whole_model_shapes
from torchtitan.checkpoint.model_args import checkpoint_args
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from torchtitan.checkpoint.states import ModelState
from torchtitan.config.manager import parse_args
from torchtitan.datasets.tokenizer import identifying_file, tokenizer_from_file
from torchtitan.errors import ConfigError, UserError, out_of_memory
from torchtitan.inference.generation import Continuation, Sampling, eval_mode, generate, positions_needed
from torchtitan.models import get_train_spec
from torchtitan.runtime import process_group
from torchtitan.runtime.reports import reporting_to_folder, say_how_it_ended

DEFAULT_TOKENIZER = "bundled:stdlib_docs/tokenizer.model"
# DCP says so whenever a single process loads, which is how one-process generation works.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class GenerateError(UserError, ValueError):
    """A mistake in the command line or the inputs: one line, exit status 2."""


@dataclasses.dataclass
class Source:
    path: str
    hf: bool
    model_name: str
    args: Any
    tokenizer: dict[str, str] | None = None  # a checkpoint's record of its run's tokenizer (Manifest)
    lora: dict[str, Any] | None = None  # a LoRA run's checkpoint: its record (Manifest.lora)


def find_source(path: str) -> Source:
    """What `--checkpoint` names, and the model it holds."""
    if not os.path.exists(path):
        raise GenerateError(f"--checkpoint {path} does not exist")
    if is_hf_folder(path):
        config = hf_folder.read_json(os.path.join(path, "config.json"), "config.json")
        found = hf_folder.family_of(config)
        if found is None:  # in the converter's words: why the family of its architecture refuses it
            raise GenerateError(f"--checkpoint {path}: {hf_folder.family_refusal(config)}")
        return Source(path, True, *found)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, folders.MANIFEST)):
        found, _ = folders.scan(path)
        complete = [f for f in found if f.problem is None]
        if not complete:
            raise GenerateError(f"--checkpoint {path} is neither a checkpoint (step-N) folder, nor a folder of them "
                                "with a complete one, nor a Hugging Face folder (config.json and safetensors)")
        path = complete[-1].path
    problem = folders.problem_with(path)
    if problem is not None:
        raise GenerateError(f"--checkpoint {path} {problem}")
    manifest = Manifest.read(path)
    name, flavor = manifest.model.get("name"), manifest.model.get("flavor")
    try:
        spec = get_train_spec(name)
    except (KeyError, UserError):
        raise GenerateError(f"--checkpoint {path} holds model {name}, which is not registered") from None
    # The args it recorded (a run's, or a conversion's), over its flavor's when that is registered.
    args = checkpoint_args(spec.config, flavor, manifest.model_args or {})
    if args is None:
        raise GenerateError(f"--checkpoint {path} holds model {name} {flavor}: it records no model args and the flavor is "
                            "not registered, so the model's sizes are unknown; convert it with torch-to-dcp --flavor")
    return Source(path, False, name, args, manifest.tokenizer or _kept_tokenizer(path), manifest.lora)


def _kept_tokenizer(path: str) -> dict[str, str] | None:
    """The tokenizer of the Hugging Face folder a checkpoint was converted from, which hf-to-dcp
    keeps beside the weights (hf_folder.SIDECAR), as a manifest's tokenizer record: the kept files'
    folder when they hold a tokenizer.json (with its config files), else its tokenizer.model."""
    kept = os.path.join(path, hf_folder.SIDECAR, "files")
    if not os.path.isfile(os.path.join(kept, "tokenizer.json")):
        kept = os.path.join(kept, hf_folder.TOKENIZER_FILE)
    digest = _sha256(kept)
    return None if digest is None else {"path": os.path.abspath(kept), "sha256": digest}


def choose_tokenizer(source: Source, given: str | None) -> tuple[str, str | None]:
    """The tokenizer to use, and a warning to print: --tokenizer, else a Hugging Face folder's own
    (the folder itself when it holds tokenizer.json, else its tokenizer.model), else the one the
    checkpoint's run trained with, else the bundled one."""
    recorded = source.tokenizer
    if given:
        if recorded and _sha256(given) not in (None, recorded["sha256"]):
            return given, (f"warning: --tokenizer {given} is not the tokenizer the run trained with ({recorded['path']}); "
                           "the text will be wrong unless the two agree")
        return given, None
    if source.hf:
        if os.path.isfile(os.path.join(source.path, "tokenizer.json")):
            return source.path, None
        own = os.path.join(source.path, hf_folder.TOKENIZER_FILE)
        if os.path.isfile(own):
            return own, None
        return DEFAULT_TOKENIZER, (f"warning: {source.path} has neither tokenizer.json nor {hf_folder.TOKENIZER_FILE}; "
                                   f"using {DEFAULT_TOKENIZER} (pass --tokenizer)")
    if recorded is None:
        return DEFAULT_TOKENIZER, (f"warning: {source.path} does not record its run's tokenizer; using {DEFAULT_TOKENIZER} "
                                   "(pass --tokenizer if the run used another)")
    path = resolve_path(recorded["path"], "the checkpoint's tokenizer", GenerateError)
    digest = _sha256(path)
    if digest is None:
        raise GenerateError(f"the run's tokenizer {recorded['path']} is gone; pass --tokenizer")
    if digest != recorded["sha256"]:
        return path, (f"warning: the run's tokenizer {recorded['path']} has changed since the checkpoint was written; "
                      "the text will be wrong unless it encodes alike")
    return path, None


def _sha256(path: str) -> str | None:
    try:
        with open(identifying_file(path), "rb") as f:  # a Hugging Face folder: its tokenizer.json
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def sequence_multiple(source: Source) -> int:
    """What every forward's sequence must be a multiple of: under tensor parallelism, an MoE layer
    computes its rank's slice of the sequence (parallelisms/expert_parallel.py), so each forward is
    padded to the number of ranks (generation.KVCache.forward)."""
    return process_group.world_size() if getattr(source.args, "num_experts", 0) else 1


def build_model(source: Source, total_len: int, device: torch.device, dtype: torch.dtype,
                base: str | None = None) -> torch.nn.Module:
    """The model on `device`, tensor-parallel over every rank when there are several, with the weights loaded."""
    spec = get_train_spec(source.model_name)
    # The RoPE table covers the prompt and the new tokens (it is not stored in checkpoints).
    args = dataclasses.replace(source.args, max_seq_len=total_len)
    with torch.device("meta"):
        model = spec.model_cls.from_model_args(args)
        whole = whole_model_shapes(model)
    world = process_group.world_size()
    if world > 1:
        # Decoding feeds one token at a time, so no sequence parallelism; full logits on every rank.
        config = parse_args(["--model.name", source.model_name, "--training.tensor_parallel_degree", str(world),
                             "--training.data_parallel_shard_degree", "1", "--training.disable_sequence_parallel",
                             "--training.disable_loss_parallel", "--activation_checkpoint.mode", "none"])
        from torchtitan.config.manager import validate_world_size

        try:
            dims = validate_world_size(config, world)
            if spec.validate_fn is not None:
                spec.validate_fn(args, dims, None, config)
        except ConfigError as e:
            raise GenerateError(f"the model cannot be split over {world} tensor-parallel processes ({e}); start a "
                                "number of processes that divides it") from None
        dims.build_mesh(device.type)
        model = spec.parallelize_fn(model, dims, config)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    state = ModelState([model])
    if source.lora:
        _load_lora_merged(source, state, base)
    elif source.hf:
        load_hf_weights(source.path, state, spec.hf_adapter, args, whole, [], False, option="--checkpoint")
    else:
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(source.path), planner=SafeLoadPlanner(),
                 no_dist=not dist.is_initialized())
    return model.to(dtype)


@torch.no_grad()
def _load_lora_merged(source: Source, state: ModelState, base: str | None) -> None:
    """A LoRA checkpoint's model: its base (from the checkpoint when it holds the whole model, else
    --base or the base its run recorded) with the adapters folded in, W + (alpha / rank) * B @ A,
    which computes what the base with its adapters computes."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.checkpoint.lora_export import merged, read_adapters

    weights, adapters = read_adapters(source.path, Manifest.read(source.path), base)
    whole = merged(weights, adapters, source.lora, source.path)
    for fqn, current in state.state_dict().items():
        if fqn not in whole:
            raise GenerateError(f"the base model of {source.path} has no {fqn}; pass --base with the model its adapters "
                                "were trained on")
        full = whole[fqn].to(current.dtype)
        if isinstance(current, DTensor):
            full = distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=None).to_local()
            current = current.to_local()
        if tuple(full.shape) != tuple(current.shape):
            raise GenerateError(f"the base model of {source.path}: {fqn} is {list(full.shape)} there, "
                                f"{list(current.shape)} in the model; pass --base with the model its adapters were trained on")
        current.copy_(full)


def check_context(source: Source, longest: int, max_new_tokens: int, extend: bool, rank0: bool) -> None:
    """Refuses a prompt longer than the positions the model was trained on, unless --extend-context; says
    so in one warning line when the generation may go past them (RoPE is extended, not trained there)."""
    trained = source.args.max_seq_len  # a run's training.seq_len; a Hugging Face folder's max_position_embeddings
    where = "max_position_embeddings of its config.json" if source.hf else "training.seq_len of its run"
    if longest > trained and not extend:
        raise GenerateError(f"the longest prompt is {longest} tokens, more than the {trained} positions the model was "
                            f"trained on ({where}); shorten it, or pass --extend-context to go past them (RoPE is "
                            "extended; the model never saw those positions)")
    if longest + max_new_tokens > trained and rank0:
        print(f"warning: the prompt ({longest} tokens) and --max-new-tokens {max_new_tokens} may reach position "
              f"{longest + max_new_tokens}, past the {trained} the model was trained on ({where}); text there is only "
              "as good as the model extrapolates", file=sys.stderr)


def _prompts(ns: argparse.Namespace) -> list[str]:
    prompts = list(ns.prompt or [])
    if ns.prompts_file:
        try:
            with open(ns.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"--prompts-file {ns.prompts_file} cannot be read ({e})") from None
    if not prompts:
        raise GenerateError("give at least one --prompt or a --prompts-file")
    return prompts


def encode_prompts(ns: argparse.Namespace, tokenizer: Any, prompts: list[str]) -> tuple[list[list[int]], int]:
    """The prompts' ids and the token that ends an answer: with --chat each prompt is a user turn
    (after --system's message) rendered with the chat template and its generation prompt, and the
    answer ends at the template's end-of-turn token; else text after BOS, ending at end-of-text."""
    if not ns.chat:
        if ns.system or ns.chat_template:
            raise GenerateError("--system and --chat-template need --chat")
        return [tokenizer.encode(p, bos=True, eos=False) for p in prompts], tokenizer.eos_id
    from torchtitan.datasets.chat import ChatError, ConversationEncoder, chat_template_for, end_of_turn_id, generation_prompt

    try:
        template = chat_template_for(tokenizer, ns.chat_template or "")
        ConversationEncoder(tokenizer, "chat", template)  # refuses a tokenizer that cannot find the template's tokens
        system = [{"role": "system", "content": ns.system}] if ns.system else []
        encoded = [generation_prompt(template, tokenizer, system + [{"role": "user", "content": p}]) for p in prompts]
        return encoded, end_of_turn_id(template, tokenizer)
    except ChatError as e:
        raise GenerateError(f"--chat: {e}".replace("sft.chat_template", "--chat-template")
                            .replace("model.tokenizer_path", "--tokenizer")) from None


def run(ns: argparse.Namespace) -> None:
    sampling = Sampling(ns.temperature, ns.top_k, ns.top_p)
    try:
        sampling.check()
    except ValueError as e:
        raise GenerateError(f"--{e}") from None
    if ns.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {ns.max_new_tokens}")
    if not 0 <= ns.seed < 2**63:
        raise GenerateError(f"--seed must lie in [0, 2**63), got {ns.seed}")
    prompts = _prompts(ns)
    device_type = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA device is available")
    device = process_group.init_distributed(device_type, timeout_seconds=300)
    source = find_source(ns.checkpoint)
    tokenizer_path, warning = choose_tokenizer(source, ns.tokenizer)
    rank0 = process_group.rank() == 0
    if warning and rank0:
        print(warning, file=sys.stderr)
    tokenizer = tokenizer_from_file(resolve_path(tokenizer_path, "--tokenizer", GenerateError), "--tokenizer")
    if tokenizer.n_words > source.args.vocab_size:
        raise GenerateError(f"the tokenizer {tokenizer_path} has {tokenizer.n_words} tokens, more than the model's "
                            f"vocabulary of {source.args.vocab_size}; pass the run's --tokenizer")
    encoded, stop_id = encode_prompts(ns, tokenizer, prompts)
    check_context(source, max(len(e) for e in encoded), ns.max_new_tokens, ns.extend_context, rank0)
    multiple = sequence_multiple(source)
    if ns.base and not source.lora:
        raise GenerateError(f"--base names the base model of a LoRA checkpoint; {source.path} holds no adapters")
    model = build_model(source, positions_needed(max(len(e) for e in encoded), ns.max_new_tokens, multiple), device,
                        getattr(torch, ns.dtype), ns.base)
    agree = None
    if dist.is_initialized():
        def agree(t: torch.Tensor) -> torch.Tensor:
            dist.broadcast(t, src=0)  # every rank continues with rank 0's tokens
            return t

    out: list[list[int]] = [[] for _ in prompts]
    texts = [Continuation(tokenizer, e, stop_id) for e in encoded]
    stream = len(prompts) == 1 and rank0
    if stream:
        print(prompts[0], end="", flush=True)
    start = time.perf_counter()
    with eval_mode(model):
        for new in generate(model, encoded, ns.max_new_tokens, sampling, stop_id, ns.seed,
                            kv_cache=not ns.no_kv_cache, agree=agree, vocab_limit=tokenizer.n_words,
                            multiple_of=multiple):
            for row, token in zip(out, new.tolist()):
                if not row or row[-1] != stop_id:
                    row.append(token)
            if stream:
                print(texts[0].new_text(out[0]), end="", flush=True)
    seconds = time.perf_counter() - start
    if not rank0:
        return
    if stream:
        print(texts[0].new_text(out[0], final=True))
    else:
        for i, (prompt, row, text) in enumerate(zip(prompts, out, texts)):
            print(f"[{i}] {prompt}{text.new_text(row, final=True)}")
    generated = sum(len(row) for row in out)
    print(f"generated {generated} tokens for {len(prompts)} prompt(s) in {seconds:.2f}s ({generated / seconds:,.1f} "
          f"tokens/s, {'KV cache' if not ns.no_kv_cache else 'no cache'}, {device.type}, {ns.dtype}"
          f"{f', tensor parallel {process_group.world_size()}' if dist.is_initialized() else ''})", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="step-N folder, a run's checkpoint folder, or a Hugging Face folder")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens reaching this probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--tokenizer", help=f"tokenizer file, or a Hugging Face tokenizer's folder (default: a Hugging Face "
                                       f"folder's own tokenizer.json or tokenizer.model, else the run's, else "
                                       f"{DEFAULT_TOKENIZER})")
    p.add_argument("--base", help="a LoRA checkpoint's base model (a checkpoint or Hugging Face folder), where it is not "
                                  "the one its run recorded (checkpoint.initial_load_path)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user turn, rendered with the chat template; "
                                                       "the answer stops at the template's end-of-turn token")
    p.add_argument("--system", help="with --chat: a system message before each prompt")
    p.add_argument("--chat-template", help="with --chat: a Jinja template file instead of the tokenizer's own")
    p.add_argument("--no-kv-cache", action="store_true", help="re-run the whole sequence at every step")
    p.add_argument("--extend-context", action="store_true",
                   help="allow a prompt longer than the positions the model was trained on (RoPE is extended past them)")
    return p


GENERATION_MEMORY_FIX = "lower --max-new-tokens or the number of prompts, or use --dtype bfloat16"


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.tokenizer:
            ns.tokenizer = resolve_path(ns.tokenizer, "--tokenizer", GenerateError)
        run(ns)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing is left to say, and stdout cannot be flushed again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # noqa: BLE001 - mistakes and failed allocations are one line; bugs re-raise
        ended = e if isinstance(e, UserError) else out_of_memory(e, GENERATION_MEMORY_FIX)
        if ended is None:
            raise
        if reporting_to_folder():  # under python -m torchtitan.runtime.launch: one line for the whole job
            return say_how_it_ended(process_group.rank(), ended)
        if process_group.rank() == 0:
            print(ended.line, file=sys.stderr)
        return ended.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    if process_group.world_size() > 1:
        # As the trainer does: gloo's threads can abort the interpreter's finalization (SIGABRT after
        # a run that finished correctly, seen about once in 16 TP runs); the output is flushed first.
        process_group.exit_process(code)
    sys.exit(code)
