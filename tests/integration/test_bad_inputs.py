"""A catalogue of bad inputs (issue 16, item 10): each one ends the run with its exit code and one
line that names the option or file, with no traceback, no input file changed and no partial output.

Every case is a row of CASES with its category; `test_bad_input` runs each one through the
cheapest runner that meets it the way a user would:

- config:   `python -m torchtitan.config.manager` (what run_llama_train.sh runs before torchrun; no torch)
- train:    one trainer process, forked from the warm launcher (tests.helpers.run_train), ~0.2 s a
            run. Not main() in-process: pytest records Python warnings instead of printing them, so
            a stray warning line on stderr would go unseen.
- ranks:    two ranks forked by the test launcher (tests/machinery/local_ranks.py), which prints the
            root cause once, whichever rank found it
- launcher: ./run_llama_train.sh with environment variables (its checks answer before torch starts)
- signal:   a running job is sent SIGINT or SIGTERM and must stop after a step, naming the newest
            checkpoint (one process, and once through run_llama_train.sh with NGPU=2)

Exit codes are the ones of torchtitan/errors.py: 2 user error, 3 non-finite loss, 4 checkpoint save
failed, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, run_train

CATEGORIES = ("config", "launcher", "data", "tokenizer", "checkpoint", "output", "sizes", "numbers", "signals")
RUNNERS = ("config", "train", "ranks", "launcher", "signal")

# Checkpointing on, every step: a run that wrongly got past its error would leave a step folder.
CHECKPOINT_EVERY_STEP = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "1")
# Inputs of every run that the package ships: the configs and the default tokenizer and corpus.
REPO_INPUTS = ("torchtitan/assets/train_configs", "torchtitan/assets/stdlib_docs")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHTITAN_REPORT_DIR", "NGPU", "LOG_RANK", "CONFIG_FILE", "TORCHTITAN_VENV",
               "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "LOCAL_ADDR", "MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT",
               "RDZV_TIMEOUT", "RDZV_PROGRESS_INTERVAL")

DIR = object()  # in Case.files: an empty folder


@dataclasses.dataclass(frozen=True)
class Link:
    """In Case.files: a symbolic link to `target` (relative to {in}), which need not exist."""

    target: str
PROSE = "The quick brown fox jumps over the lazy dog while the module reads its arguments. " * 80  # ~1,500 tokens


# A manifest of pre-tokenized shards naming one part of 10 uint16 tokens in 1 document.
TOKEN_MANIFEST = {"format": "torchtitan-tokens", "version": 1, "dtype": "uint16", "vocab_size": 2256,
                  "tokenizer": {"name": "tokenizer.model", "sha256": "0" * 64},
                  "files": [{"tokens": "p.bin", "index": "p.idx", "num_tokens": 10, "num_documents": 1}]}


# Token shards the trainer reads past its tokenizer check (the bundled tokenizer's sha256): one
# document of 2,000 uint16 ids in which token 100 is 60000, beyond the vocabulary of 2256.
BAD_ID_SHARDS = {
    "tokens/manifest.json": json.dumps({
        **TOKEN_MANIFEST, "files": [{"tokens": "p.bin", "index": "p.idx", "num_tokens": 2000, "num_documents": 1}],
        "tokenizer": {"name": "tokenizer.model", "sha256": hashlib.sha256(
            (REPO_ROOT / "torchtitan/assets/stdlib_docs/tokenizer.model").read_bytes()).hexdigest()}}),
    "tokens/p.bin": struct.pack("<2000H", 1, *(3 + i % 2000 if i != 99 else 60000 for i in range(1998)), 2),
    "tokens/p.idx": struct.pack("<2q", 0, 2000),
}


def jsonl(*docs: object) -> str:
    return "".join(json.dumps(d) + "\n" for d in docs)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input. `args` and `expect` may name {in} (the case's input folder), {out} (its dump
    folder) and {job} (a copy of a saved job, for checkpoint cases)."""

    id: str
    category: str
    args: tuple[str, ...]
    expect: tuple[str, ...]  # substrings of the one `error:` / `stopped:` line
    code: int = 2
    runner: str = "train"
    files: tuple[tuple[str, object], ...] = ()  # created under {in}: text, bytes or DIR
    env: tuple[tuple[str, str], ...] = ()
    saved: str = ""  # a saved job copied to {job}: "untied" (steps 2 and 4) or "tied" (a step-0 seed)
    damage: str = ""  # a change made to {job} after copying it, a key of DAMAGE
    trained: bool = False  # the error comes after training started: step folders may exist
    checkpointing: bool = True  # train/ranks runners: add CHECKPOINT_EVERY_STEP
    memory_limit_gb: int = 0  # train runner: a fresh process under this address-space limit

    @property
    def prefix(self) -> str:
        return "stopped:" if self.runner == "signal" else "error:"


def case(id: str, category: str, args: str, expect: str | tuple[str, ...], *, files: dict | None = None,
         env: dict | None = None, **kw) -> Case:
    return Case(id, category, tuple(args.split()), (expect,) if isinstance(expect, str) else expect,
                files=tuple((files or {}).items()), env=tuple((env or {}).items()), **kw)


def config(id: str, args: str, expect: str | tuple[str, ...], category: str = "config", **kw) -> Case:
    return case(id, category, args, expect, runner="config", **kw)


def launcher(id: str, env: dict, expect: str, args: str = "", **kw) -> Case:
    return case(id, "launcher", args, expect, runner="launcher", env=env, **kw)


TOML_SYNTAX = "[training]\nsteps = \n"
CASES: list[Case] = [
    # --- config: checked by python -m torchtitan.config.manager, as the launcher does ---------------
    config("unknown option", "--training.stepz 3", "unknown option --training.stepz; did you mean 'steps'?"),
    config("unknown section", "--trainig.steps 3", "unknown config section in --trainig.steps"),
    config("positional argument", "steps=3", "unexpected argument 'steps=3'"),
    config("option without value", "--training.batch_size", "--training.batch_size"),
    config("int option given text", "--training.steps abc", "training.steps (command line) must be an integer"),
    config("int option given a float", "--training.batch_size 2.5", "training.batch_size (command line) must be an integer"),
    config("float option given text", "--optimizer.lr fast", "optimizer.lr (command line) must be a number"),
    config("bool option given text", "--training.compile maybe", "training.compile (command line) must be true or false"),
    config("choice not offered", "--optimizer.name SGD", "optimizer.name (command line) must be one of AdamW, Adam"),
    config("norm type not offered", "--model.norm_type batchnorm", "model.norm_type (command line) must be one of"),
    config("zero steps", "--training.steps 0", "training.steps must be >= 1"),
    config("negative learning rate", "--optimizer.lr -1e-3", "optimizer.lr must be > 0"),
    config("beta1 of 1.5", "--optimizer.beta1 1.5", "optimizer.beta1 and beta2 must lie in [0, 1)"),
    config("lr_min above 1", "--training.lr_min 2", "training.lr_min"),
    config("shard degree 0", "--training.data_parallel_shard_degree 0", "training.data_parallel_shard_degree must be >= 1 or -1"),
    config("dataset_shards 0", "--training.dataset_shards 0", "training.dataset_shards must be >= 1 or -1"),
    config("dataset_num_workers negative", "--training.dataset_num_workers -1", "training.dataset_num_workers must be >= 0"),
    config("dataset_mix without weights", "--training.dataset_mix stdlib_docs",
           "training.dataset_mix entry 'stdlib_docs' is not 'source:weight'"),
    config("dataset_mix weight not a number", "--training.dataset_mix stdlib_docs:lots",
           "training.dataset_mix entry 'stdlib_docs:lots': weight 'lots' is not a number"),
    config("dataset_mix and dataset_path", "--training.dataset_mix stdlib_docs:1 --training.dataset_path x.jsonl",
           "training.dataset_mix and training.dataset_path both name the training data"),
    config("checkpoint interval 0", "--checkpoint.interval 0", "checkpoint.interval must be >= 1"),
    config("keep_latest_k negative", "--checkpoint.keep_latest_k -1", "checkpoint.keep_latest_k must be >= 0"),
    config("selective AC option bad", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option x",
           "activation_checkpoint.selective_ac_option"),
    config("offload option bad", "--activation_checkpoint.offload 0", "activation_checkpoint.offload must be 'none', 'all'"),
    config("load_step without checkpointing", "--checkpoint.load_step 2", "checkpoint.load_step needs checkpoint.enable_checkpoint"),
    config("export dtype without weights-only", "--checkpoint.export_dtype bfloat16", "checkpoint.export_dtype"),
    config("async TP without TP", "--experimental.enable_async_tensor_parallel", "experimental.enable_async_tensor_parallel needs"),
    config("float8 scales without all-gather", "--float8.enable_float8_linear --float8.precompute_float8_dynamic_scale_for_fsdp",
           "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather"),
    config("float8 rowwise with float8 all-gather",
           "--float8.enable_float8_linear --float8.recipe rowwise --float8.enable_fsdp_float8_all_gather",
           "float8.enable_fsdp_float8_all_gather needs float8.recipe tensorwise"),
    config("torchtitan's other converters", "--model.converters float8,mx",
           "model.converters 'mx' is not supported: float8 is this version's only converter"),
    config("chat data mixed with text", "--sft.format chat --training.dataset_mix stdlib_docs:1",
           "sft.format reads one source of conversations"),
    config("chat template without chat data", "--sft.chat_template t.jinja", "sft.chat_template is set but sft.format"),
    config("LoRA without a base", "--lora.rank 4", "lora"),
    config("LoRA with float8", "--lora.rank 4 --float8.enable_float8_linear --checkpoint.initial_load_path x", "float8"),
    config("not implemented yet", "--experimental.enable_compiled_autograd",
           "experimental.enable_compiled_autograd is not implemented yet"),
    config("dry run world size negative", "--job.dry_run --job.dry_run_world_size -3",
           "job.dry_run_world_size must be a number of ranks"),
    config("dry run degrees do not divide its world", "--job.dry_run --job.dry_run_world_size 6 --training.tensor_parallel_degree 4",
           "does not divide the world size 6 (job.dry_run_world_size)"),
    config("device memory negative", "--memory_estimation.enabled --memory_estimation.device_memory_gib -1",
           "memory_estimation.device_memory_gib must be a finite number >= 0"),
    config("degrees do not multiply to world size", "--training.tensor_parallel_degree 3", "training.tensor_parallel_degree",
           env={"WORLD_SIZE": "2"}),
    config("shard degree does not fit world size", "--training.data_parallel_shard_degree 4",
           "training.data_parallel_shard_degree", env={"WORLD_SIZE": "2"}),
    config("seed checkpoint on two ranks", "--checkpoint.create_seed_checkpoint", "checkpoint.create_seed_checkpoint runs on one process",
           env={"WORLD_SIZE": "2"}),
    config("context parallel odd sequence", "--experimental.context_parallel_degree 2 --training.seq_len 63",
           "training.seq_len 63 must divide by 2 x experimental.context_parallel_degree", env={"WORLD_SIZE": "2"}),
    config("sequence parallel uneven sequence", "--training.tensor_parallel_degree 2 --training.seq_len 63",
           "training.seq_len 63 must divide by training.tensor_parallel_degree 2", env={"WORLD_SIZE": "2"}),
    config("unknown context parallel method", "--experimental.context_parallel_degree 2 "
           "--experimental.context_parallel_method alltoall", "experimental.context_parallel_method",
           env={"WORLD_SIZE": "2"}),
    config("expert parallel degree 0", "--training.expert_parallel_degree 0", "training.expert_parallel_degree must be >= 1, got 0"),
    config("expert parallel degree does not divide the ranks", "--training.expert_parallel_degree 3",
           "training.expert_parallel_degree 3 must divide the ranks it is taken from (dp_shard 2 = 2)", env={"WORLD_SIZE": "2"}),
    config("TOML syntax error", "--job.config_file {in}/bad.toml", "malformed TOML in {in}/bad.toml",
           files={"bad.toml": TOML_SYNTAX}),
    config("TOML unknown key", "--job.config_file {in}/bad.toml", "unknown option training.stepz in {in}/bad.toml",
           files={"bad.toml": "[training]\nstepz = 3\n"}),
    config("TOML unknown section", "--job.config_file {in}/bad.toml", "unknown config section [trainig] in {in}/bad.toml",
           files={"bad.toml": "[trainig]\nsteps = 3\n"}),
    config("TOML string for an int", "--job.config_file {in}/bad.toml", "training.steps ({in}/bad.toml) must be a",
           files={"bad.toml": '[training]\nsteps = "10"\n'}),
    config("TOML value outside a section", "--job.config_file {in}/bad.toml", "'steps' in {in}/bad.toml must be a [section] table",
           files={"bad.toml": "steps = 3\n"}),
    config("TOML choice not offered", "--job.config_file {in}/bad.toml", "optimizer.name ({in}/bad.toml) must be one of",
           files={"bad.toml": '[optimizer]\nname = "SGD"\n'}),
    config("config file missing", "--job.config_file {in}/nope.toml", "config file not found: {in}/nope.toml"),
    config("bundled config not shipped", "--job.config_file bundled:train_configs/nope.toml",
           "job.config_file 'bundled:train_configs/nope.toml': the torchtitan package ships no such file"),
    config("config file is a folder", "--job.config_file {in}/conf", "config file is a directory: {in}/conf",
           files={"conf": DIR}),
    config("config file not UTF-8", "--job.config_file {in}/bad.toml", "config file {in}/bad.toml is not valid UTF-8",
           files={"bad.toml": b"[job]\ndescription = \"\xff\xfe\"\n"}),
    config("config file under a file", "--job.config_file {in}/afile/x.toml", "cannot read config file {in}/afile/x.toml",
           files={"afile": "a file, not a folder\n"}),
    case("unknown model name", "config", "--model.name gpt5", "unknown model.name 'gpt5'"),
    case("custom_import module missing", "config", "--experimental.custom_import nosuch_models_xyz",
         "experimental.custom_import 'nosuch_models_xyz': no module named 'nosuch_models_xyz'"),
    case("custom_import registers a drifted TrainSpec", "config",
         "--experimental.custom_import tests.faults.drifted_spec --model.name drifted",
         "TrainSpec 'drifted': build_dataloader_fn tests.faults.drifted_spec.old_dataloader needs parameter "
         "'dp_degree', which the trainer does not pass"),
    case("unknown model flavor", "config", "--model.flavor 5B", "unknown model.flavor '5B'"),
    case("float8 on CPU", "config", "--float8.enable_float8_linear", "float8.enable_float8_linear needs CUDA"),
    # Model-dependent layout checks of the preflight, met by rank 0 of a job of WORLD_SIZE ranks before it joins
    # the process group (one process stands for the job: a check that let the layout through would fail to join).
    case("expert parallelism with a dense model", "config",
         "--model.name qwen3 --model.flavor debugmodel --training.expert_parallel_degree 2",
         "training.expert_parallel_degree 2 needs a mixture-of-experts model; model qwen3 debugmodel is dense",
         env={"WORLD_SIZE": "2"}),
    case("expert parallelism with a Llama model", "config", "--training.expert_parallel_degree 2",
         "training.expert_parallel_degree 2 needs a mixture-of-experts model; llama3 tiny has no experts",
         env={"WORLD_SIZE": "2"}),
    case("experts not divisible by the expert parallel degree", "config",
         "--model.name qwen3 --model.flavor debugmodel_moe --training.expert_parallel_degree 3",
         "training.expert_parallel_degree 3 must divide the 8 experts of model qwen3 debugmodel_moe", env={"WORLD_SIZE": "3"}),
    case("MoE under tensor parallelism with DDP", "config",
         "--model.name qwen3 --model.flavor debugmodel_moe --training.tensor_parallel_degree 2 "
         "--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 1",
         ("training.tensor_parallel_degree 2", "training.data_parallel_replicate_degree 2"), env={"WORLD_SIZE": "4"}),

    # --- launcher: run_llama_train.sh's own checks, before torch starts --------------------------------
    launcher("NGPU=0", {"NGPU": "0"}, "NGPU must be a positive number of processes, got '0'"),
    launcher("dry run does not fit", {"NGPU": "2"}, "would need", trained=False,
             args="--job.dry_run --memory_estimation.device_memory_gib 0.001"),
    launcher("NGPU=abc", {"NGPU": "abc"}, "NGPU must be a positive number of processes, got 'abc'"),
    launcher("NGPU=-1", {"NGPU": "-1"}, "NGPU must be a positive number of processes, got '-1'"),
    launcher("NGPU=1.5", {"NGPU": "1.5"}, "NGPU must be a positive number of processes, got '1.5'"),
    launcher("LOG_RANK=5 with 2 ranks", {"NGPU": "2", "LOG_RANK": "5"}, "LOG_RANK 5 is not a rank of this job (NGPU=2"),
    launcher("LOG_RANK=x", {"NGPU": "2", "LOG_RANK": "x"}, "LOG_RANK must be a rank or comma-separated ranks"),
    launcher("LOG_RANK=0,", {"NGPU": "2", "LOG_RANK": "0,"}, "LOG_RANK must be a rank or comma-separated ranks"),
    launcher("OMP_NUM_THREADS=abc", {"NGPU": "2", "OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS must be a positive number"),
    launcher("OMP_NUM_THREADS=0", {"NGPU": "2", "OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS must be a positive number"),
    launcher("CONFIG_FILE missing", {"NGPU": "2", "CONFIG_FILE": "{in}/nope.toml"}, "config file not found: {in}/nope.toml"),
    launcher("bad option through the launcher", {"NGPU": "2"}, "unknown option --training.stepz", args="--training.stepz 3"),
    launcher("degrees do not fit NGPU", {"NGPU": "2"}, "training.tensor_parallel_degree", args="--training.tensor_parallel_degree 4"),
    launcher("seed checkpoint with NGPU=2", {"NGPU": "2"}, "checkpoint.create_seed_checkpoint runs on one process",
             args="--checkpoint.create_seed_checkpoint"),
    launcher("NNODES=0", {"NNODES": "0"}, "NNODES must be a positive number of nodes, got '0'"),
    launcher("NNODES=2 without RDZV_ENDPOINT", {"NGPU": "2", "NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=host:port"),
    launcher("RDZV_ENDPOINT without a port", {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "node0"},
             "NNODES=2 needs RDZV_ENDPOINT=host:port, node 0's address and a free port every node can reach, got 'node0'"),
    launcher("NODE_RANK out of range", {"NGPU": "2", "NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "node0:29500"},
             "NODE_RANK must be this node's index, 0..1 (NNODES=2), got '2'"),
    launcher("RDZV_TIMEOUT=10m", {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "node0:29500", "RDZV_TIMEOUT": "10m"},
             "RDZV_TIMEOUT must be the seconds the nodes wait for each other at the rendezvous (1 or more), got '10m'"),
    launcher("RDZV_TIMEOUT=0", {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "node0:29500", "RDZV_TIMEOUT": "0"},
             "RDZV_TIMEOUT must be the seconds the nodes wait for each other at the rendezvous (1 or more), got '0'"),
    launcher("RDZV_PROGRESS_INTERVAL=0",
             {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "node0:29500", "RDZV_PROGRESS_INTERVAL": "0"},
             "RDZV_PROGRESS_INTERVAL must be the seconds between a waiting node's progress lines (1 or more), got '0'"),
    # The launcher's pre-check knows the data-parallel degree (2 ranks of FSDP): refused before torchrun.
    launcher("dataset_shards not a multiple of the ranks", {"NGPU": "2"},
             "training.dataset_shards 3 must be a multiple of the data-parallel degree 2", args="--training.dataset_shards 3"),
    launcher("MAX_RESTARTS=-1", {"NGPU": "2", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a number of restarts (0 or more)"),
    # Found by the config fuzzing (test_config_fuzz.py): bash's arithmetic wrapped these past 2**63 (NODE_RANK
    # and LOG_RANK were accepted as negative numbers), a port beyond 65535 passed, and a line break split the line.
    launcher("NODE_RANK=2**63", {"NGPU": "2", "NNODES": "2", "NODE_RANK": "9223372036854775808", "RDZV_ENDPOINT": "node0:29500"},
             "NODE_RANK must be this node's index, 0..1 (NNODES=2), got '9223372036854775808'"),
    launcher("LOG_RANK=2**64-1", {"NGPU": "2", "LOG_RANK": "18446744073709551615"},
             "LOG_RANK must be a rank or comma-separated ranks (e.g. 0 or 0,3), got '18446744073709551615'"),
    launcher("RDZV_ENDPOINT port beyond 65535", {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "node0:99999999"},
             "NNODES=2 needs RDZV_ENDPOINT=host:port, node 0's address and a free port every node can reach, got "
             "'node0:99999999'"),
    launcher("NGPU with a line break", {"NGPU": "2\n3"}, "NGPU must be a positive number of processes, got '2\\n3'"),

    # --- data ----------------------------------------------------------------------------------------
    case("dataset file missing", "data", "--training.dataset_path {in}/no/such.jsonl", "dataset file not found: {in}/no/such.jsonl"),
    case("unknown dataset name", "data", "--training.dataset c4_nope", "unknown training.dataset 'c4_nope'"),
    case("validation dataset unknown, found at start-up", "data", "--validation.enabled --validation.dataset c4_nope",
         "unknown validation.dataset 'c4_nope'"),
    config("validation every 0 steps", "--validation.freq 0", "validation.freq must be >= 1, got 0"),
    case("bundled dataset_path not shipped", "data", "--training.dataset_path bundled:stdlib_docs/nope.jsonl",
         "training.dataset_path 'bundled:stdlib_docs/nope.jsonl': the torchtitan package ships no such file"),
    case("empty .jsonl", "data", "--training.dataset_path {in}/empty.jsonl", "{in}/empty.jsonl has no documents",
         files={"empty.jsonl": ""}),
    case("blank lines only", "data", "--training.dataset_path {in}/blank.jsonl", "{in}/blank.jsonl has no documents",
         files={"blank.jsonl": "\n\n   \n"}),
    case("empty .txt", "data", "--training.dataset_path {in}/empty.txt", "{in}/empty.txt has no documents",
         files={"empty.txt": ""}),
    case(".txt with 2 ranks", "data", "--training.dataset_path {in}/book.txt",
         ("{in}/book.txt has no documents for data shard 1 of 2", "each .txt file is one document"),
         runner="ranks", files={"book.txt": PROSE}),
    case("one-document .jsonl with 2 ranks", "data", "--training.dataset_path {in}/one.jsonl",
         "has no documents for data shard 1 of 2", runner="ranks", files={"one.jsonl": jsonl({"text": PROSE})}),
    case("bad JSON line in rank 1's share", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:2",
         runner="ranks", files={"data.jsonl": jsonl({"text": PROSE}) + '{"text": "unclosed\n' + jsonl({"text": PROSE})}),
    case("bad JSON line", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:2: not a JSON object",
         files={"data.jsonl": jsonl({"text": "short"}) + "{not json\n" + jsonl({"text": PROSE})}),
    case("wrong text field", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:1: not a JSON object with a 'text' field",
         files={"data.jsonl": jsonl({"content": PROSE})}),
    case("text is a number", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:1: 'text' holds int",
         files={"data.jsonl": jsonl({"text": 42})}),
    case("JSON line is a list", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:1: not a JSON object",
         files={"data.jsonl": jsonl([PROSE])}),
    case("invalid UTF-8 in .jsonl", "data", "--training.dataset_path {in}/data.jsonl", "{in}/data.jsonl:1: invalid UTF-8",
         files={"data.jsonl": b'{"text": "caf\xe9 au lait"}\n'}),
    case("invalid UTF-8 in .txt", "data", "--training.dataset_path {in}/data.txt", "{in}/data.txt: invalid UTF-8",
         files={"data.txt": PROSE.encode() + b"\xff\xfe"}),
    case("unsupported suffix", "data", "--training.dataset_path {in}/data.csv", "files in {in}/data.csv",
         files={"data.csv": "text\nhello\n"}),
    case("folder with no data files", "data", "--training.dataset_path {in}/corpus", "files in {in}/corpus",
         files={"corpus/README.md": "nothing to train on\n", "corpus/notes.csv": "a,b\n"}),
    case("empty folder", "data", "--training.dataset_path {in}/corpus", "files in {in}/corpus", files={"corpus": DIR}),
    case("broken .jsonl link in a data folder", "data", "--training.dataset_path {in}/corpus",
         "{in}/corpus/b.jsonl is a broken symbolic link (to {in}/unmounted/b.jsonl, which does not exist); point it at "
         "the data or remove it", files={"corpus/a.jsonl": jsonl({"text": PROSE}), "corpus/b.jsonl": Link("unmounted/b.jsonl")}),
    case("dataset_path a broken link", "data", "--training.dataset_path {in}/data.jsonl",
         "{in}/data.jsonl is a broken symbolic link (to {in}/gone.jsonl, which does not exist)", files={"data.jsonl": Link("gone.jsonl")}),
    case("glob matching nothing", "data", "--training.dataset_path {in}/*.jsonl", "{in}/*.jsonl"),
    case("parquet that is not parquet", "data", "--training.dataset_path {in}/data.parquet", "{in}/data.parquet",
         files={"data.parquet": b"PAR1 this is not a parquet file"}),
    case("fewer tokens than one batch", "data", "--training.dataset_path {in}/tiny.jsonl",
         "{in}/tiny.jsonl gives data shard 0 of 1 only", files={"tiny.jsonl": jsonl({"text": "hello world"})}),
    case("mixture source missing", "data", "--training.dataset_mix stdlib_docs:1,{in}/nope.jsonl:1",
         "dataset file not found: {in}/nope.jsonl"),
    case("token shards truncated", "data", "--training.dataset_path {in}/tokens", "{in}/tokens/p.bin holds 4 bytes, but "
         "{in}/tokens/manifest.json says 20 (truncated or rewritten? tokenize the data again)",
         files={"tokens/manifest.json": json.dumps(TOKEN_MANIFEST), "tokens/p.bin": b"\0" * 4, "tokens/p.idx": b"\0" * 16}),
    case("token shards with an id beyond the vocabulary", "data", "--training.dataset_path {in}/tokens",
         "{in}/tokens/p.bin: token id 60000 at token 100 is outside the vocabulary of 2256 that manifest.json records",
         files=BAD_ID_SHARDS),
    case("token shards' index past the end", "data", "--training.dataset_path {in}/tokens",
         "{in}/tokens/p.idx is damaged: it ends at token 12, but {in}/tokens/manifest.json says the part holds 10 tokens",
         files={"tokens/manifest.json": json.dumps(TOKEN_MANIFEST), "tokens/p.bin": b"\0" * 20,
                "tokens/p.idx": struct.pack("<2q", 0, 12)}),
    case("token shards of another format", "data", "--training.dataset_path {in}/tokens",
         "{in}/tokens/manifest.json is not a manifest of pre-tokenized shards",
         files={"tokens/manifest.json": json.dumps({**TOKEN_MANIFEST, "format": "megatron"})}),
    case("gzip stream that is not gzip", "data", "--training.dataset_path {in}/data.jsonl.gz --training.dataset_num_workers 2",
         "{in}/data.jsonl.gz is not a readable gzip file", files={"data.jsonl.gz": b"plain text, not gzip\n"}),
    case("shards do not divide the batch", "data", "--training.dataset_shards 3", "training.batch_size 8 must be divisible by the 3 data shards"),

    # --- tokenizer -----------------------------------------------------------------------------------
    case("tokenizer missing", "tokenizer", "--model.tokenizer_path {in}/no.model", "tokenizer file not found: {in}/no.model"),
    case("bundled tokenizer not shipped", "tokenizer", "--model.tokenizer_path bundled:../config_manager.py",
         "model.tokenizer_path 'bundled:../config_manager.py': the torchtitan package ships no such file"),
    case("tokenizer empty", "tokenizer", "--model.tokenizer_path {in}/empty.model", "tokenizer file is empty: {in}/empty.model",
         files={"empty.model": ""}),
    case("tokenizer garbage", "tokenizer", "--model.tokenizer_path {in}/garbage.model",
         "tokenizer file {in}/garbage.model is not a valid sentencepiece model", files={"garbage.model": b"\x00\x01garbage" * 50}),
    case("tokenizer is a folder", "tokenizer", "--model.tokenizer_path {in}/tok",
         "model.tokenizer_path {in}/tok is a folder", files={"tok/tokenizer.model": "QQ== 0\n"}),
    case("tiktoken file with a bad line", "tokenizer", "--model.tokenizer_path {in}/tok.model",
         "{in}/tok.model:3: not a tiktoken rank line", files={"tok.model": "QQ== 0\nQg== 1\nnot-base64!! two\n"}),
    case("tiktoken ranks with a gap", "tokenizer", "--model.tokenizer_path {in}/tok.model",
         "tokenizer file {in}/tok.model: ranks must be 0..2", files={"tok.model": "QQ== 0\nQg== 1\nQw== 7\n"}),
    case("tiktoken rank not a number", "tokenizer", "--model.tokenizer_path {in}/tok.model",
         "{in}/tok.model:2: not a tiktoken rank line", files={"tok.model": "QQ== 0\nQg== one\n"}),
    case("tokenizer is random bytes", "tokenizer", "--model.tokenizer_path {in}/tok.bin", "{in}/tok.bin",
         files={"tok.bin": bytes(range(256)) * 8}),

    # --- checkpoint ----------------------------------------------------------------------------------
    case("load_step that does not exist", "checkpoint", "--job.dump_folder {job} --checkpoint.load_step 3",
         "checkpoint.load_step 3: there is no step-3 in {job}/checkpoint", saved="untied"),
    case("load_step in a new job", "checkpoint", "--checkpoint.load_step 2",
         "checkpoint.load_step 2: there is no step-2 in {out}/checkpoint"),
    case("initial_load_path missing", "checkpoint", "--checkpoint.initial_load_path {in}/no/such",
         "checkpoint.initial_load_path {in}/no/such does not exist"),
    case("initial_load_path not a checkpoint", "checkpoint", "--checkpoint.initial_load_path {in}/notes",
         "checkpoint.initial_load_path {in}/notes is not a checkpoint", files={"notes/readme.txt": "not a checkpoint\n"}),
    case("initial_load_path is a file", "checkpoint", "--checkpoint.initial_load_path {job}/checkpoint/step-4/manifest.json",
         "checkpoint.initial_load_path {job}/checkpoint/step-4/manifest.json", saved="untied"),
    case("truncated checkpoint file", "checkpoint", "--job.dump_folder {job} --checkpoint.load_step 4",
         "{job}/checkpoint/step-4 is damaged", saved="untied", damage="truncate"),
    case("checkpoint without .metadata", "checkpoint", "--job.dump_folder {job} --checkpoint.load_step 4",
         "{job}/checkpoint/step-4", saved="untied", damage="no metadata"),
    case("garbled manifest", "checkpoint", "--job.dump_folder {job} --checkpoint.load_step 4",
         "{job}/checkpoint/step-4", saved="untied", damage="garble manifest"),
    case("truncated initial_load_path", "checkpoint", "--checkpoint.initial_load_path {job}/checkpoint/step-4",
         "{job}/checkpoint/step-4", saved="untied", damage="truncate"),
    case("checkpoint of another flavor", "checkpoint",
         "--job.dump_folder {job} --experimental.custom_import tests.faults.checkpoint --model.flavor tiny_narrow",
         "checkpoint {job}/checkpoint/step-4 (written by llama3 tiny) does not fit llama3 tiny_narrow",
         saved="untied"),
    case("untied checkpoint resumed tied", "checkpoint", "--job.dump_folder {job} --model.flavor tiny_tied",
         "{job}/checkpoint/step-4", saved="untied"),
    case("tied seed loaded untied", "checkpoint", "--checkpoint.initial_load_path {job}/checkpoint/step-0",
         "{job}/checkpoint/step-0", saved="tied"),
    case("llama3 checkpoint into llama2", "checkpoint", "--model.name llama2 --checkpoint.initial_load_path {job}/checkpoint/step-4",
         "{job}/checkpoint/step-4", saved="untied"),
    case("other data shards", "checkpoint", "--job.dump_folder {job} --training.dataset_shards 2",
         "{job}/checkpoint/step-4 keeps the data position of 1 data shards, but training.dataset_shards is 2", saved="untied"),

    # --- output folders ------------------------------------------------------------------------------
    case("dump folder a broken link", "output", "--job.dump_folder {in}/scratch/run",
         ("job.dump_folder {in}/scratch/run cannot be created", "{in}/scratch is a broken symbolic link"),
         files={"scratch": Link("unmounted/scratch")}),
    case("dump folder is a file", "output", "--job.dump_folder {in}/afile", "job.dump_folder {in}/afile is a file",
         files={"afile": "a file\n"}),
    case("dump folder under a file", "output", "--job.dump_folder {in}/afile/run", "job.dump_folder {in}/afile/run",
         files={"afile": "a file\n"}),
    case("checkpoint folder is a file", "output", "--job.dump_folder {in}/job", "checkpoint.folder {in}/job/checkpoint",
         files={"job/checkpoint": "a file\n"}),
    case("checkpoint folder under a file", "output", "--job.dump_folder {in}/job --checkpoint.folder afile/ckpt",
         "checkpoint.folder {in}/job/afile/ckpt", files={"job/afile": "a file\n"}),
    case("TensorBoard folder is a file", "output", "--job.dump_folder {in}/job --metrics.enable_tensorboard",
         "{in}/job/tb", files={"job/tb": "a file\n"}),
    case("profiler traces folder is a file", "output",
         "--job.dump_folder {in}/job --profiling.enable_profiling --profiling.profile_freq 2 --profiling.save_traces_folder traces",
         "{in}/job/traces", files={"job/traces": "a file\n"}),
    case("disk full at the first save", "output", "--experimental.custom_import tests.faults.free_space",
         "checkpoint of step 1 not saved", code=4, env={"TT_FAKE_FREE_BYTES": "1048576"}, trained=True),
    # With 2 ranks DCP pickles the coordinator's refusal to hand it to the other rank (once a TypeError).
    case("disk full at the first save, 2 ranks", "output", "--experimental.custom_import tests.faults.free_space",
         ("checkpoint of step 1 not saved", "not enough space for the checkpoint"), code=4,
         env={"TT_FAKE_FREE_BYTES": "1048576"}, trained=True, runner="ranks"),
    case("disk full at the first async save, 2 ranks", "output",
         "--experimental.custom_import tests.faults.free_space --checkpoint.async_mode async",
         ("checkpoint of step 1 not saved", "not enough space for the checkpoint"), code=4,
         env={"TT_FAKE_FREE_BYTES": "1048576"}, trained=True, runner="ranks"),

    # --- sizes ---------------------------------------------------------------------------------------
    case("batch_size 10000000", "sizes", "--training.batch_size 10000000", "training.batch_size 10000000"),
    case("seq_len 1000000000", "sizes", "--training.seq_len 1000000000", "training.seq_len 1000000000"),
    config("warmup longer than the run", "--training.warmup_steps 20", "training.warmup_steps 20 is longer than the run",
           category="sizes"),
    config("batch_size 0", "--training.batch_size 0", "training.batch_size must be >= 1", category="sizes"),
    # Under an address-space limit: a trainer that misses this tries to allocate 1.6 TB and, without
    # the limit, is killed by the kernel's OOM killer minutes later (taking the machine's memory with it).
    case("405B model on a CPU", "sizes", "--model.flavor 405B", "405B", memory_limit_gb=16),
    case("dataset smaller than one batch", "sizes", "--training.dataset_path {in}/small.jsonl --training.seq_len 1024",
         "fewer than its share of one batch", files={"small.jsonl": jsonl({"text": PROSE[:2000]}, {"text": PROSE[:2000]})}),

    # --- numbers -------------------------------------------------------------------------------------
    case("lr 1e6", "numbers", "--optimizer.lr 1e6", ("non-finite loss at step", "optimizer.lr", "newest checkpoint: {out}/checkpoint/step-"),
         code=3, trained=True),
    case("lr 1e6 without checkpoints", "numbers", "--optimizer.lr 1e6", ("non-finite loss at step", "checkpointing is off"),
         code=3, trained=True, checkpointing=False),
    config("lr nan", "--optimizer.lr nan", "optimizer.lr must be a finite number, got nan", category="numbers"),
    config("lr inf", "--optimizer.lr inf", "optimizer.lr", category="numbers"),
    config("lr given as 1e-3e2", "--optimizer.lr 1e-3e2", "optimizer.lr (command line) must be a number", category="numbers"),
    config("eps 0", "--optimizer.eps 0", "optimizer.eps must be > 0", category="numbers"),
    config("weight decay negative", "--optimizer.weight_decay -0.1", "optimizer.weight_decay", category="numbers"),
    config("max_norm nan", "--training.max_norm nan", "training.max_norm", category="numbers"),
    config("beta2 of 1", "--optimizer.beta2 1", "optimizer.beta1 and beta2 must lie in [0, 1)", category="numbers"),
    config("negative flight recorder size", "--comm.trace_buf_size -1", "comm.trace_buf_size must be >= 0",
           category="numbers"),
    config("watchdog timeout of 0", "--comm.train_timeout_seconds 0", "comm.train_timeout_seconds must be >= 1, got 0",
           category="numbers"),

    # --- signals: a running job stops after a step and names its newest checkpoint ------------------------
    case("SIGINT one process", "signals", "", "SIGINT received; stopped after step", code=130, runner="signal", trained=True),
    # SIGTERM is a preemption: the step all ranks agreed on is saved, and exit code 75 asks for a relaunch.
    case("SIGTERM one process", "signals", "", "SIGTERM received; stopped after step", code=75, runner="signal", trained=True),
    case("SIGINT run_llama_train.sh NGPU=2", "signals", "", "SIGINT received; stopped after step", code=130,
         runner="signal", env={"NGPU": "2"}, trained=True),
]


def _replace(path: Path, data: bytes) -> None:
    """Writes a new file in place of `path`: the saved job's files are hard links to the fixture's."""
    path.unlink()
    path.write_bytes(data)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncate": lambda job: _replace(job / "checkpoint/step-4/__0_0.distcp",
                                     (job / "checkpoint/step-4/__0_0.distcp").read_bytes()[:1000]),
    "no metadata": lambda job: (job / "checkpoint/step-4/.metadata").unlink(),
    "garble manifest": lambda job: _replace(job / "checkpoint/step-4/manifest.json", b"{not json"),
}


# ---------------------------------------------------------------------------------------------
# Saved jobs for the checkpoint cases, made once per module and copied by each case


@pytest.fixture(scope="module")
def saved_jobs(tmp_path_factory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"saved-{kind}")
            if kind == "untied":  # step-2 and step-4 of the tiny model
                extra = ["--training.steps", "4", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
            else:  # a seed checkpoint (step-0) of the tied flavor
                extra = ["--model.flavor", "tiny_tied", "--checkpoint.create_seed_checkpoint"]
            run_train([*TINY_RUN, *extra, "--job.dump_folder", str(folder)])
            made[kind] = folder
        return made[kind]

    return get


# ---------------------------------------------------------------------------------------------
# Running a case


@dataclasses.dataclass
class Folders:
    root: Path

    @property
    def inputs(self) -> Path:
        return self.root / "in"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def job(self) -> Path:
        return self.root / "job"

    def fill(self, text: str) -> str:
        return text.format_map({"in": self.inputs, "out": self.out, "job": self.job})


def prepare(c: Case, folders: Folders, saved_jobs: Callable[[str], Path]) -> None:
    folders.inputs.mkdir()
    for rel, content in c.files:
        path = folders.inputs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is DIR:
            path.mkdir()
        elif isinstance(content, Link):
            path.symlink_to(folders.inputs / content.target)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if c.saved:
        # Hard links: a copy of 190 MB per case would cost more than the run. A run that wrote into
        # a checkpoint file in place would change the fixture too, and is caught by the hashes.
        shutil.copytree(saved_jobs(c.saved), folders.job, copy_function=os.link)
    if c.damage:
        DAMAGE[c.damage](folders.job)


def snapshot(*roots: Path) -> dict[str, str]:
    """Content hash and mode of every file and folder under the roots (the inputs of a case)."""
    found = {}
    for root in roots:
        if not root.exists():
            continue
        for p in [root, *sorted(root.rglob("*"))]:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IRUSR:
                digest = hashlib.sha1(p.read_bytes()).hexdigest()
            else:
                digest = "folder" if stat.S_ISDIR(st.st_mode) else "other"
            found[str(p)] = f"{digest} {oct(st.st_mode)} {st.st_size if stat.S_ISREG(st.st_mode) else ''}"
    return found


def step_folders(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("step-*") if p.is_dir()}


def leftovers(root: Path) -> list[str]:
    """Unfinished output: partial checkpoint folders, temporary files, write probes."""
    return sorted(str(p) for p in root.rglob("*")
                  if ".partial" in p.name or p.name.endswith(".tmp") or p.name.startswith(".write-probe"))


def clean_env(c: Case, folders: Folders) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: folders.fill(v) for k, v in c.env})
    return env


TINY_WITHOUT_CONFIG = [a for i, a in enumerate(TINY_RUN)
                       if a != "--job.config_file" and (i == 0 or TINY_RUN[i - 1] != "--job.config_file")]


def run_case(c: Case, folders: Folders) -> subprocess.CompletedProcess:
    args = [folders.fill(a) for a in c.args]
    out = ["--job.dump_folder", str(folders.out)]
    env = clean_env(c, folders)
    if c.runner == "config":
        cmd = [sys.executable, "-m", "torchtitan.config.manager", *TINY_RUN, *out, *args]
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    if c.runner == "launcher":
        cmd = ["./run_llama_train.sh", *TINY_WITHOUT_CONFIG, *out, *args]
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    trainer_args = [*TINY_RUN, *out, *(CHECKPOINT_EVERY_STEP if c.checkpointing else ()), *args]
    if c.memory_limit_gb:
        limit = c.memory_limit_gb * 2**30
        cmd = [sys.executable, "-m", "torchtitan.train", *trainer_args]
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    nproc = 2 if c.runner == "ranks" else 1
    return run_train(trainer_args, nproc=nproc, check=False, timeout=180, extra_env=dict(c.env))


STEP_LINE = re.compile(r"step: +2[ /]")


def run_signal_case(c: Case, folders: Folders) -> subprocess.CompletedProcess:
    """Starts a long run that checkpoints every 2 steps, waits for step 2's metrics line, then
    sends the signal: SIGINT to the whole process group (what Ctrl-C in a terminal does),
    SIGTERM to the launched process alone (what `kill` or a scheduler does)."""
    sig = signal.SIGINT if c.id.startswith("SIGINT") else signal.SIGTERM
    args = [*TINY_WITHOUT_CONFIG, "--training.steps", "1000", "--training.batch_size", "2", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", "2", "--job.dump_folder", str(folders.out)]
    env = clean_env(c, folders)
    if "NGPU" in env:
        cmd = ["./run_llama_train.sh", *args]
    else:
        cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", "train_configs/debug_model.toml", *args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watchdog = threading.Timer(240, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if STEP_LINE.search(line):
                if sig == signal.SIGINT:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
                break
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        watchdog.cancel()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(seen) + stdout, stderr)


def signal_problems(line: str, folders: Folders) -> list[str]:
    """The stopped line names a step after the signal and the newest checkpoint on disk: after a
    preemption signal (SIGTERM), the one saved at the step the run stopped after."""
    match = re.search(r"stopped after step (\d+)(?:; newest checkpoint| and saved its checkpoint): (\S+?)(?:;|$)", line)
    if not match:
        return [f"the stopped line names no step and newest checkpoint: {line!r}"]
    step, named = int(match[1]), match[2]
    preempted = "saved its checkpoint" in line
    newest = folders.out / "checkpoint" / f"step-{step if preempted else step - step % 2}"
    problems = []
    if step < 2:
        problems.append(f"stopped after step {step}, before the step the signal followed")
    if named != str(newest) or not newest.is_dir():
        problems.append(f"named {named}, but the newest checkpoint after step {step} is {newest}")
    return problems


def check(c: Case, result: subprocess.CompletedProcess, folders: Folders, inputs_before: dict, steps_before: set) -> list[str]:
    problems = []
    if result.returncode != c.code:
        problems.append(f"exit code {result.returncode}, expected {c.code}")
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith(c.prefix)]
    if len(ours) != 1:
        problems.append(f"{len(ours)} lines start with {c.prefix!r}, expected exactly one")
    for ln in ours[:1]:
        problems += [f"the line lacks {folders.fill(e)!r}" for e in c.expect if folders.fill(e) not in ln]
        if c.runner == "signal":
            problems += signal_problems(ln, folders)
    if len(lines) != len(ours):
        problems.append(f"{len(lines) - len(ours)} other line(s) on stderr")
    if "Traceback" in result.stdout + result.stderr:
        problems.append("a Traceback in the output")
    inputs_after = snapshot(*input_roots(folders))
    changed = sorted(set(inputs_before.items()) ^ set(inputs_after.items()))
    if changed:
        problems.append(f"input files changed: {sorted({path for path, _ in changed})}")
    left = leftovers(folders.root)
    if left:
        problems.append(f"partial output left: {left}")
    if not c.trained:
        new = sorted(step_folders(folders.root) - steps_before)
        if new:
            problems.append(f"checkpoint step folders created by a run that should not have trained: {new}")
    return problems


def input_roots(folders: Folders) -> list[Path]:
    return [folders.inputs, folders.job / "checkpoint", *(REPO_ROOT / p for p in REPO_INPUTS)]


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(autouse=True)
def no_outer_launch(monkeypatch):
    """A test process started under a launcher (or with its variables exported) must not pass them on."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


# The fast tier runs the first case of each category and of each runner.
FAST = {c.id for c in [*{c.category: c for c in reversed(CASES)}.values(), *{c.runner: c for c in reversed(CASES)}.values()]}


@pytest.mark.parametrize("c", [pytest.param(c, marks=pytest.mark.fast) if c.id in FAST else c for c in CASES],
                         ids=[f"{c.category}: {c.id}" for c in CASES])
def test_bad_input(c: Case, tmp_path, saved_jobs):
    folders = Folders(tmp_path)
    prepare(c, folders, saved_jobs)
    inputs_before = snapshot(*input_roots(folders))
    steps_before = step_folders(tmp_path)
    result = run_signal_case(c, folders) if c.runner == "signal" else run_case(c, folders)
    problems = check(c, result, folders, inputs_before, steps_before)
    assert not problems, ("\n".join(f"- {p}" for p in problems) + f"\nexit code {result.returncode}\n"
                          f"stderr:\n{result.stderr[-4000:]}\nstdout (end):\n{result.stdout[-1500:]}")


def test_catalogue_covers_every_category():
    counts = collections.Counter(c.category for c in CASES)
    assert len(CASES) >= 60, len(CASES)
    assert set(counts) == set(CATEGORIES), counts
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
    assert all(c.runner in RUNNERS and c.expect for c in CASES)
    assert all(not c.damage or c.saved for c in CASES), "damage applies to a saved job"
    # At most one case starts torchrun ranks (each costs seconds of imports); the rest are cheap.
    torchrun = [c for c in CASES if c.runner == "signal" and ("NGPU", "2") in c.env]
    assert len(torchrun) == 1
