#!/usr/bin/env -S sh -c 'exec "${0%/*}/project_python.sh" "$0" "$@"'
"""One side of scripts/side_by_side.py: trains one Llama 3 shape for a few steps through one stack
and prints one result line (`SIDE_BY_SIDE {json}`).

    python -I side_by_side_worker.py --stack ours|anchor --shape 1B --seq 4096 --batch 2 ...

Both stacks are imported as `torchtitan`, so each side runs in its own interpreter (the anchor,
torchtitan from the package index, in its own environment) with `-I`: neither the script's folder
nor PYTHONPATH nor the user's site reaches sys.path, and `torchtitan` is whatever that environment
installed. This file imports nothing of either stack at module level, so it runs under both.

What differs between the sides is only the stack: its Llama 3 model, its parallelize function
with its own options (compile, activation checkpointing, mixed precision, float8) and its loss.
What is shared is everything the comparison must hold equal: the shape, the synthetic token
batches (one seeded generator, drawn on the host), the step's order (forward, loss, backward,
gradient clipping to 1.0, fused AdamW) and the timing. On CUDA the timed steps are bracketed by
synchronisations; on CPU the figure that survives a shared machine is tokens per CPU-second of
this process (all its threads).
"""

# ruff: noqa: I001 - isort takes `torchtitan` for this project's own, which on the anchor's side it is not
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

RESULT_PREFIX = "SIDE_BY_SIDE "

# shape -> (flavor in the anchor, flavor in ours, changes to ours, vocabulary, (layers, heads, head
# dim)). The anchor's `debugmodel` has 6 layers and a 2,048-token vocabulary; ours is given 6 layers.
SHAPES = {
    "debug": ("debugmodel", "debugmodel", {"n_layers": 6}, 2048, (6, 16, 16)),
    "1B": ("1B", "1B", {}, 128256, (16, 32, 64)),
    "3B": ("3B", "3B", {}, 128256, (28, 24, 128)),
    "8B": ("8B", "8B", {}, 128256, (32, 32, 128)),
}
AC_MODES = ("none", "full", "selective")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stack", choices=("ours", "anchor"), required=True)
    p.add_argument("--shape", choices=tuple(SHAPES), default="debug")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", choices=AC_MODES, default="none")
    p.add_argument("--float8", choices=FLOAT8_RECIPES, default="none")
    p.add_argument("--untied", dest="tied", action="store_false",
                   help="1B and 3B with separate embedding and output weights (as torchtitan 0.2 builds them; "
                        "Llama 3.2 ties them, as ours and torchtitan 0.3 do by default)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype of both (fp32 master weights): default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--site", default=None, help="folders (os.pathsep-separated) put first on sys.path, in order: "
                                                "where this side's torchtitan is (this repository, or the anchor's "
                                                "--target install) first, then what else it imports")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--anchor-attention", choices=("flex", "sdpa"), default=None,
                   help="the anchor's attention: flex (its default for language models; CUDA only, as it has no "
                        "CPU backward) or its causal SDPA block; default flex on CUDA, sdpa on CPU")
    return p.parse_args(argv)


def token_batches(args: argparse.Namespace, vocab: int):
    """The same batches on both sides: (inputs, labels) on the host, from one seeded generator."""
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.warmup + args.steps):
        window = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def single_process_env() -> None:
    """A one-rank job's variables, as torchrun would set them, for stacks that read them."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class Side:
    """What one stack gives the shared loop: its model (parameters), and its step's forward,
    loss and backward; `describe` says what it applied."""
    model: torch.nn.Module
    device: torch.device

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Ours(Side):
    """This project: the trainer's own build sequence (preflight, parallelize, materialise) and its
    training step's forward_backward, configured by command-line options as a user would."""

    def __init__(self, args: argparse.Namespace):
        import dataclasses

        from torchtitan.config.manager import parse_args as parse_job
        from torchtitan.config.preflight import preflight
        from torchtitan.models import get_train_spec
        from torchtitan.runtime import device_setup, process_group
        from torchtitan.trainer.step import build_model_parts, forward_backward, with_training_loss

        _, flavor, changes, vocab, _ = SHAPES[args.shape]
        spec = get_train_spec("llama3")
        if not args.tied and spec.config[flavor].tie_word_embeddings:
            changes = {**changes, "tie_word_embeddings": False}
        if changes:  # a flavor of the anchor's shape, registered for this process only
            flavor_name = f"side_by_side_{args.shape}"
            spec.config[flavor_name] = dataclasses.replace(spec.config[flavor], **changes)
            flavor = flavor_name
        argv = ["--model.name", "llama3", "--model.flavor", flavor, "--training.seq_len", str(args.seq),
                "--training.batch_size", str(args.batch), "--training.steps", "1000",
                "--training.seed", str(args.seed), "--activation_checkpoint.mode", args.ac,
                "--training.mixed_precision_param", args.dtype,
                "--job.dump_folder", os.environ.get("SIDE_BY_SIDE_DUMP", "/tmp/side_by_side_ours")]
        if args.ac == "selective":
            argv += ["--activation_checkpoint.selective_ac_option", "op"]
        if args.compile:
            argv += ["--training.compile"]
        if args.float8 != "none":
            argv += ["--float8.enable_float8_linear", "--float8.recipe", args.float8]
            if not torch.cuda.is_available():
                argv += ["--float8.emulate"]  # no float8 units: the same code, matmuls in high precision
        job = parse_job(argv)
        self.device_type = device_setup.device_type()
        parallel_dims, plan, train_spec, _, model_args, model = preflight(job, 1, tokenizer=_Vocabulary(vocab))
        self.device = process_group.init_distributed(self.device_type, 600)
        parallel_dims.build_mesh(self.device_type)
        torch.manual_seed(args.seed)
        self.train_spec = with_training_loss(train_spec, job, parallel_dims, self.device_type)
        parts, _ = build_model_parts(job, self.train_spec, parallel_dims, plan, model, model_args, self.device)
        self.model, self.parallel_dims, self._fb = parts[0], parallel_dims, forward_backward
        self.tied = bool(getattr(model_args, "tie_word_embeddings", False))

    def forward_backward(self, inputs, labels):
        return self._fb(self.train_spec, self.parallel_dims, [self.model], None, [(inputs, labels)], self.device)


class _Vocabulary:
    """The tokenizer stand-in: synthetic batches need only the vocabulary's size."""
    bos_id, eos_id, pad_id = 0, 1, -1

    def __init__(self, n_words: int):
        self.n_words = n_words


def anchor_device() -> str:
    """The anchor's device type. torchtitan (0.2 and 0.3) takes it to be CUDA whenever torch reports
    no accelerator, and its modules copy that name at import; on a CPU-only machine every loaded
    module of the anchor is told the CPU is its device."""
    if torch.cuda.is_available():
        return "cuda"
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            if getattr(module, "device_module", None) is torch.cuda:
                module.device_module = torch.cpu
    return "cpu"


class Anchor(Side):
    """torchtitan 0.3.0 from the package index, used as its trainer uses it for one GPU: its model
    registry (FlexAttention, its only causal language-model attention besides varlen), model built
    on the meta device, its parallelize_llama (activation checkpointing, per-block compile, FSDP2's
    mixed-precision policy on a one-rank mesh), materialised and initialised by its own init,
    attention masks from positions as its trainer builds them, and its compiled cross-entropy."""

    def __init__(self, args: argparse.Namespace):
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.config.configs import CommConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.models.llama3 import model_registry

        device_type = anchor_device()

        flavor, _, _, vocab, _ = SHAPES[args.shape]
        if not args.tied and args.shape in ("1B", "3B"):
            raise SystemExit("torchtitan 0.3's 1B and 3B tie their embeddings, as Llama 3.2 does: drop --untied")
        converters = None
        if args.float8 == "tensorwise":
            raise SystemExit("torchtitan 0.3.0 has no tensorwise float8 (rowwise only): use --float8 rowwise")
        if args.float8 == "rowwise":
            from torchtitan.components.quantization import Float8LinearConverter
            # The output projection stays in high precision, as ours keeps it; emulated on CPU, as ours is.
            converters = [Float8LinearConverter.Config(recipe_name="rowwise", model_compile_enabled=args.compile,
                                                       filter_fqns=["lm_head"], emulate=not torch.cuda.is_available())]
        spec = model_registry(flavor, attn_backend="flex", converters=converters)
        config = spec.model
        self.attention = args.anchor_attention or ("flex" if torch.cuda.is_available() else "sdpa")
        if self.attention == "sdpa":
            # Its causal SDPA block (what its trainer runs without masks): FlexAttention has no
            # backward on CPU, and on a GPU this is the kernel our stack runs for the same work.
            from torchtitan.models.common.attention import ScaledDotProductAttention
            for layer in config.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
        assert config.vocab_size == vocab, (config.vocab_size, vocab)
        training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, steps=args.warmup + args.steps,
                                  mixed_precision_param=args.dtype)
        parallelism = ParallelismConfig()
        compile_config = CompileConfig(enable=args.compile)
        ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[args.ac]
        world = dist_utils.init_distributed(CommConfig(trace_buf_size=0))
        parallel_dims = ParallelDims.from_config(parallelism, world)
        self.device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
        if device_type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            model = config.build()
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                    compile_config=compile_config, ac_config=ac,
                                    dump_folder=os.environ.get("SIDE_BY_SIDE_DUMP", "/tmp/side_by_side_anchor"))
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=vocab).build(compile_config=compile_config)
        self.tied = bool(getattr(config, "enable_weight_tying", False))

    def forward_backward(self, inputs, labels):
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        # Its data loaders give every sequence its positions, and its trainer builds FlexAttention's
        # block mask from them each step (here one document a sequence: causal).
        positions = torch.arange(inputs.shape[1], device=self.device).expand_as(inputs)
        masks = self.model.get_attention_masks(positions=positions) if self.attention == "flex" else None
        pred = self.model(inputs, positions=positions, attention_masks=masks)
        valid = (labels >= 0).sum()
        loss, _ = self.loss_fn(pred, labels, valid)
        del pred
        loss.backward()
        return loss


class Anchor02(Side):
    """torchtitan 0.2.x (the newest release that imports under PyTorch 2.11; 0.3.0 needs a later
    PyTorch), used as its trainer uses it on one device: a JobConfig from its own command-line
    parser, its TransformerModelArgs (its flavors have 8B; 1B and 3B are its args with the published
    shapes, untied: it has no tied embeddings), its converters (float8), its parallelize_llama, its
    init, its compiled cross-entropy and, without FSDP, its autocast for mixed precision."""

    def __init__(self, args: argparse.Namespace):
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args
        from torchtitan.models.llama3.infra.parallelize import parallelize_llama
        from torchtitan.protocols.model_converter import build_model_converters

        device_type = anchor_device()

        if args.tied and args.shape in ("1B", "3B"):
            raise SystemExit(f"torchtitan 0.2.x has no tied embeddings: run shape {args.shape} with --untied")
        if args.float8 == "tensorwise":
            raise SystemExit("the side-by-side compares rowwise float8 (torchtitan 0.3.0 has no tensorwise)")
        flavor, _, _, vocab, (layers, heads, head_dim) = SHAPES[args.shape]
        argv = ["--model.name", "llama3", "--model.flavor", "8B" if flavor not in llama3_args else flavor,
                "--training.seq_len", str(args.seq), "--training.local_batch_size", str(args.batch),
                "--training.mixed_precision_param", args.dtype, "--activation_checkpoint.mode", args.ac,
                "--job.dump_folder", os.environ.get("SIDE_BY_SIDE_DUMP", "/tmp/side_by_side_anchor")]
        if args.ac == "selective":
            argv += ["--activation_checkpoint.selective_ac_option", "op"]
        if args.compile:
            argv += ["--compile.enable"]
        if args.float8 == "rowwise":  # the output projection in high precision, as ours; emulated on CPU, as ours
            argv += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise",
                     "--quantize.linear.float8.filter_fqns", "output"]
            if not torch.cuda.is_available():
                argv += ["--quantize.linear.float8.emulate"]
        job = ConfigManager().parse_args(argv)
        if flavor in llama3_args:
            model_args = llama3_args[flavor]
        else:  # its args with the published shape (Llama 3.2's FFN sizes, as ours and 0.3.0 have them)
            dim = heads * head_dim
            model_args = TransformerModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8, vocab_size=vocab,
                                              ffn_dim_multiplier={"1B": 1.5, "3B": 1.0}[args.shape], multiple_of=256,
                                              rope_theta=500000)
        model_args.update_from_config(job)
        world = dist_utils.init_distributed(job.comm)
        par = job.parallelism
        parallel_dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=1, cp=1, tp=1, pp=1, ep=1,
                                     etp=1, world_size=world)
        self.device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
        if device_type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(args.seed)
        with torch.device("meta"):
            model = Transformer(model_args)
        build_model_converters(job, parallel_dims).convert(model)
        model = parallelize_llama(model, parallel_dims, job)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model, self.tied, self.attention = model, False, model_args.attn_type
        self.loss_fn = build_cross_entropy_loss(job)
        self.amp = dist_utils.maybe_enable_amp(parallel_dims, args.dtype, device_type)

    def forward_backward(self, inputs, labels):
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with self.amp:
            pred = self.model(inputs)
            loss = self.loss_fn(pred, labels) / (labels >= 0).sum()
        del pred
        loss.backward()
        return loss


def anchor_side(args: argparse.Namespace) -> Side:
    """The anchor's adapter for the torchtitan release installed: 0.3 (its current API) or 0.2."""
    version = _dist_version() or "0.3"
    return Anchor02(args) if version.startswith(("0.1", "0.2")) else Anchor(args)


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, those of embedding tables), tied ones counted once."""
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    return total, embedding


def flops_per_token(args: argparse.Namespace, params: int, embedding: int, tied: bool) -> int:
    """One formula for both sides: 6 FLOPs a matmul parameter a token (the input embedding is a
    lookup, unless tied to the output projection) and the attention's 6 x layers x heads x 2 x
    head dim x seq, causality not discounted (the convention of both stacks)."""
    layers, heads, head_dim = SHAPES[args.shape][4]
    return 6 * (params if tied else params - embedding) + 6 * layers * heads * 2 * head_dim * args.seq


def run(args: argparse.Namespace) -> dict:
    single_process_env()
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    side = Ours(args) if args.stack == "ours" else anchor_side(args)
    cuda = side.device.type == "cuda"
    params = [p for p in side.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, fused=cuda, foreach=None if cuda else True)
    losses, step_seconds = [], []
    wall0 = cpu0 = 0.0
    for step, (inputs, labels) in enumerate(token_batches(args, SHAPES[args.shape][3])):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            wall0, cpu0 = time.perf_counter(), time.process_time()
        began = time.perf_counter()
        loss = side.forward_backward(inputs, labels)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - began)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    tokens = args.steps * args.batch * args.seq
    total, embedding = count_params(side.model)
    losses = [float(x.full_tensor() if hasattr(x, "full_tensor") else x) for x in losses]
    result = {"stack": args.stack, "attention": getattr(side, "attention", "sdpa"), "shape": args.shape, "seq": args.seq, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "compile": args.compile, "ac": args.ac, "float8": args.float8,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": args.dtype, "params": total, "embedding_params": embedding, "tied": side.tied,
              "flops_per_token": flops_per_token(args, total, embedding, side.tied),
              "tokens_per_second": tokens / wall, "tokens_per_cpu_second": tokens / cpu if cpu > 0 else None,
              "step_seconds": step_seconds, "first_loss": losses[0], "last_loss": losses[-1],
              "memory_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    result["stack_version"] = _dist_version()
    return result


def _dist_version() -> str | None:
    from importlib import metadata
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.site:
        sys.path[:0] = [os.path.abspath(folder) for folder in args.site.split(os.pathsep) if folder]
    result = run(args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
