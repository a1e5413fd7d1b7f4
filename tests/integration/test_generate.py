"""scripts/generate.py as users run it, on a tiny model trained until it knows a short text by
heart: greedy generation from its first words gives the rest of it, in one process, over 2
tensor-parallel ranks under torchrun, and from the run's final weights as a Hugging Face folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import generate as generate_script
from tests.helpers import REPO_ROOT, TINY_RUN, read_metrics, run_train
from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.weights import weights_manifest, write_weights
from torchtitan.models import get_train_spec
from torchtitan.models.llama.model import ModelArgs, Transformer

SCRIPT = REPO_ROOT / "scripts" / "generate.py"
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps under the warm kitchen table all "
        "afternoon.")
PROMPT = "The quick brown"
TIKTOKEN = str(REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs" / "tokenizer.model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny model after 25 steps on nothing but TEXT (lr 1e-2): its loss is near zero."""
    folder = tmp_path_factory.mktemp("overfit")
    data = folder / "text.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT}) + "\n" for _ in range(50)))
    run_train([*TINY_RUN, "--training.steps", "25", "--training.warmup_steps", "5", "--optimizer.lr", "1e-2",
               "--training.batch_size", "4", "--training.dataset_path", str(data), "--metrics.log_freq", "5",
               "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000", "--checkpoint.model_weights_only",
               "--checkpoint.last_save_in_hf", "--job.dump_folder", str(folder / "out")])
    assert read_metrics(folder / "out")[-1]["loss"] < 0.05
    return folder / "out" / "checkpoint"


def generate(*args, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    result = subprocess.run([*launch, str(SCRIPT), *map(str, args)], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# PROMPT is 7 tokens with BOS: 57 new ones fill the 64 positions the model trained on (the sentence needs 41).
NEW = "57"


@pytest.mark.fast
def test_greedy_generation_reproduces_the_memorised_text(trained):
    result = generate("--checkpoint", trained, "--prompt", PROMPT, "--max-new-tokens", NEW)
    print(f"sample: {result.stdout.strip()!r}\n{result.stderr.strip()}")
    assert result.stdout.strip() == TEXT  # streamed, then stopped at EOS
    assert "KV cache, cpu, float32" in result.stderr  # (cache = re-running the sequence: test_generation.py)
    assert "warning" not in result.stderr  # the checkpoint names its run's tokenizer


def test_tensor_parallel_generation_gives_the_same_text(trained):
    result = generate("--checkpoint", trained, "--prompt", PROMPT, "--prompt", "The cat sleeps", "--max-new-tokens",
                      NEW, nproc=2)
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"[0] {TEXT}"
    assert lines[1].startswith("[1] The cat sleeps") and "tensor parallel 2" in result.stderr


def generate_here(capsys, *args) -> tuple[str, str]:
    """The script's main() in this process -> (stdout, stderr): no interpreter start-up (the
    greedy test above runs the script as a user does)."""
    status = generate_script.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    return out, err


def test_the_runs_hugging_face_export_generates_the_same_text(trained, capsys):
    export = trained / "step-25-hf"
    assert (export / "tokenizer.model").is_file()
    out, _ = generate_here(capsys, "--checkpoint", export, "--prompt", PROMPT, "--max-new-tokens", NEW)
    assert out.strip() == TEXT




def run_main(capsys, *args) -> tuple[int, str]:
    """The script's main() in this process (mistakes end before any model is built)."""
    status = generate_script.main([str(a) for a in args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("args,expected", [
    (["--checkpoint", "no/such/folder", "--prompt", "x"], "error: --checkpoint no/such/folder does not exist"),
    (["--prompt", "x", "--top-p", "0"], "error: --top-p must lie in (0, 1], got 0.0"),
    (["--prompt", "x", "--temperature", "-1"], "error: --temperature must be >= 0 (0 is greedy), got -1.0"),
    (["--max-new-tokens", "0", "--prompt", "x"], "error: --max-new-tokens must be >= 1, got 0"),
    (["--prompt", "x", "--temperature", "nan"], "error: --temperature must be >= 0 (0 is greedy), got nan"),
    (["--prompt", "x", "--seed", str(2**64)], f"error: --seed must lie in [0, 2**63), got {2**64}"),
    (["--prompt", "x", "--tokenizer", "no/such.model"], "error: tokenizer file not found: no/such.model (set --tokenizer)"),
    ([], "error: give at least one --prompt or a --prompts-file"),
])
def test_mistakes_are_one_line(capsys, trained, args, expected):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(trained), *args]
    status, err = run_main(capsys, *args)
    assert status == 2 and err.strip() == expected


def test_a_prompt_longer_than_the_trained_positions_is_refused_unless_asked_for(capsys, trained):
    """The model trained on 64 positions (training.seq_len, recorded in its checkpoint): a longer prompt is
    refused; --extend-context runs it, saying once that RoPE goes past what the model saw."""
    long_prompt = " ".join(["fox"] * 80)
    status, err = run_main(capsys, "--checkpoint", trained, "--prompt", long_prompt)
    assert status == 2 and err.splitlines() == [
        "error: the longest prompt is 161 tokens, more than the 64 positions the model was trained on (training.seq_len "
        "of its run); shorten it, or pass --extend-context to go past them (RoPE is extended; the model never saw those "
        "positions)"]
    status, err = run_main(capsys, "--checkpoint", trained, "--prompt", long_prompt, "--extend-context",
                           "--max-new-tokens", "2")
    assert status == 0 and err.splitlines()[0] == (
        "warning: the prompt (161 tokens) and --max-new-tokens 2 may reach position 163, past the 64 the model was trained "
        "on (training.seq_len of its run); text there is only as good as the model extrapolates"), err
    assert len(err.splitlines()) == 2 and err.splitlines()[1].startswith("generated ")


@pytest.mark.fast
def test_a_folder_that_is_no_checkpoint_is_one_line(capsys, tmp_path):
    status, err = run_main(capsys, "--checkpoint", tmp_path, "--prompt", "x")
    assert status == 2 and err.strip().startswith(f"error: --checkpoint {tmp_path} is neither a checkpoint")


# --- mistakes found before any model is built, in this process ------------------------------------

SMALL = dict(dim=64, n_layers=1, n_heads=4, vocab_size=300, max_seq_len=64)  # fewer tokens than the bundled tokenizer's


def hf_folder_of(folder: Path, config: dict | None = None) -> Path:
    """A Hugging Face folder of a one-block Llama with a 300-token vocabulary (or with another config.json)."""
    adapter, args = get_train_spec("llama3").hf_adapter, ModelArgs(**SMALL)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    folder.mkdir()
    hf_folder.write_fresh(str(folder), hf_folder.to_hf({k: torch.zeros(v) for k, v in shapes.items()}, args, adapter),
                          config or adapter.hf_config(args), 10**9)
    return folder


def checkpoint_of(folder: Path, flavor: str) -> Path:
    """A weights-only checkpoint whose manifest names llama3 `flavor`."""
    model = {"tok_embeddings.weight": torch.zeros(4, 2)}
    write_weights(model, str(folder), weights_manifest(model, "llama3", flavor))
    return folder


@pytest.mark.fast
def test_checkpoints_that_no_registered_model_reads_are_one_line(capsys, tmp_path):
    gpt2 = hf_folder_of(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64})
    config = get_train_spec("llama3").hf_adapter.hf_config(ModelArgs(**SMALL))
    yarn = hf_folder_of(tmp_path / "yarn", {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    unknown = checkpoint_of(tmp_path / "unknown", "unknown")
    other = tmp_path / "other"
    write_weights({"w": torch.zeros(2)}, str(other), weights_manifest({"w": torch.zeros(2)}, "gpt9", "small"))
    damaged = checkpoint_of(tmp_path / "damaged", "tiny")
    (damaged / "__0_0.distcp").write_bytes(b"")
    cases = {
        gpt2: f"error: --checkpoint {gpt2}: no registered model reads its config.json (architectures GPT2LMHeadModel)",
        # A Llama that the Llama family refuses: its reason, as the converter gives it.
        yarn: f"error: --checkpoint {yarn}: config.json: rope_scaling rope_type 'yarn' is not supported (only default "
              "and llama3 RoPE are)",
        unknown: f"error: --checkpoint {unknown} holds model llama3 unknown: it records no model args and the flavor "
                 "is not registered, so the model's sizes are unknown; convert it with torch-to-dcp --flavor",
        other: f"error: --checkpoint {other} holds model gpt9, which is not registered",
        damaged: f"error: --checkpoint {damaged} is damaged: its file __0_0.distcp has 0 bytes, ",
    }
    for folder, expected in cases.items():
        status, err = run_main(capsys, "--checkpoint", folder, "--prompt", "x")
        assert status == 2 and err.startswith(expected) and len(err.splitlines()) == 1, err


@pytest.mark.fast
def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(capsys, tmp_path):
    folder = hf_folder_of(tmp_path / "hf")
    status, err = run_main(capsys, "--checkpoint", folder, "--prompt", "x")
    assert status == 2 and err.splitlines() == [
        f"warning: {folder} has neither tokenizer.json nor tokenizer.model; using bundled:stdlib_docs/tokenizer.model "
        "(pass --tokenizer)",
        "error: the tokenizer bundled:stdlib_docs/tokenizer.model has 2256 tokens, more than the model's vocabulary of "
        "300; pass the run's --tokenizer"]


@pytest.mark.fast
def test_a_prompts_file_that_cannot_be_read_is_one_line(capsys, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    cases = {tmp_path / "nope.txt": "[Errno 2] No such file or directory: ",
             tmp_path / "latin1.txt": "'utf-8' codec can't decode byte 0xe9 in position 3",
             tmp_path: "[Errno 21] Is a directory: "}
    for path, expected in cases.items():
        status, err = run_main(capsys, "--checkpoint", tmp_path, "--prompts-file", path)
        assert status == 2 and err.startswith(f"error: --prompts-file {path} cannot be read ({expected}"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    status, err = run_main(capsys, "--checkpoint", tmp_path, "--prompt", "x", "--device", "cuda")
    assert status == 2 and err == "error: --device cuda: no CUDA device is available\n"


def test_the_runs_tokenizer_that_is_gone_is_one_line(tmp_path):
    source = generate_script.Source(str(tmp_path), False, "llama3", ModelArgs(**SMALL),
                                    {"path": str(tmp_path / "gone.model"), "sha256": "0" * 64})
    with pytest.raises(generate_script.GenerateError, match=f"^the run's tokenizer {tmp_path}/gone.model is gone; pass "
                                                            "--tokenizer$"):
        generate_script.choose_tokenizer(source, None)


def test_a_model_that_the_processes_cannot_split_is_one_line(monkeypatch):
    """Under torchrun with 3 processes: 4 heads do not split 3 ways. Refused before any process group exists."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    source = generate_script.Source("ckpt", False, "llama3", ModelArgs(**SMALL))
    with pytest.raises(generate_script.GenerateError) as raised:
        generate_script.build_model(source, 16, torch.device("cpu"), torch.float32)
    message = str(raised.value)
    assert message.startswith("the model cannot be split over 3 tensor-parallel processes (training.tensor_parallel_degree "
                              "3 must divide the n_heads (4) of model llama3") and "\n" not in message
    assert message.endswith("); start a number of processes that divides it")


def test_an_interrupt_ends_the_line_and_exits_130(capsys, monkeypatch):
    def interrupted(ns):
        print("The quick", end="", flush=True)  # a streamed continuation, cut short by Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_script, "run", interrupted)
    assert generate_script.main(["--checkpoint", "ckpt", "--prompt", "x"]) == 130
    assert capsys.readouterr() == ("The quick", "\n")


def test_a_reader_that_went_away_exits_141_quietly(capsys, monkeypatch, tmp_path):
    """`generate.py ... | head`: stdout goes to /dev/null, so the interpreter's last flush cannot fail again."""
    def broken_pipe(ns):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(generate_script, "run", broken_pipe)
    with open(tmp_path / "stdout", "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert generate_script.main(["--checkpoint", "ckpt", "--prompt", "x"]) == 141
        stdout.write("unseen")
        stdout.flush()
        assert os.path.samestat(os.fstat(stdout.fileno()), os.stat(os.devnull))
        monkeypatch.undo()  # sys.stdout back to pytest's capture before this file closes
    assert (tmp_path / "stdout").read_text() == ""
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def moe_seed(tmp_path_factory):
    """A Qwen3-MoE seed checkpoint (initialised, not trained) whose run used the sentencepiece tokenizer."""
    folder = tmp_path_factory.mktemp("moe_seed")
    run_train([*TINY_RUN, "--job.config_file", "bundled:train_configs/qwen3_moe_debug.toml", "--model.flavor", "tiny_moe",
               "--model.tokenizer_path", "bundled:stdlib_docs/sentencepiece.model",
               "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(folder)])
    return folder / "checkpoint" / "step-0"


def test_moe_tensor_parallel_generation_equals_one_process_with_the_runs_own_tokenizer(moe_seed):
    """An MoE layer under tensor parallelism computes its rank's slice of the sequence; one
    decoding token would leave rank 1 none, so each forward is padded to the number of ranks. The
    checkpoint's manifest names the sentencepiece tokenizer its run used, which is taken unasked."""
    args = ("--checkpoint", moe_seed, "--prompt", PROMPT, "--prompt", "The cat", "--max-new-tokens", "12")
    alone = generate(*args)
    assert "warning" not in alone.stderr
    assert generate(*args, nproc=2).stdout == alone.stdout
    path, warning = generate_script.choose_tokenizer(generate_script.find_source(str(moe_seed)), None)
    assert path.endswith("sentencepiece.model") and warning is None
    path, warning = generate_script.choose_tokenizer(generate_script.find_source(str(moe_seed)), TIKTOKEN)
    assert path == TIKTOKEN and "is not the tokenizer the run trained with" in warning


CHAT = [{"role": "user", "content": "Reverse: stone cloud river"}, {"role": "assistant", "content": "river cloud stone"}]


def test_chat_generation_renders_the_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
    """A tiny model fine-tuned on one conversation (sft.format chat, the bundled chat tokenizer):
    --chat renders the prompt as a user turn with the generation prompt, so the model answers with
    the memorised reply, and generation ends at the template's <|im_end|>: the reply and that
    token, nothing after it."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(50)))
    run_train([*TINY_RUN, "--model.tokenizer_path", "bundled:chat_tokenizer", "--sft.format", "chat",
               "--training.dataset_path", str(data), "--training.steps", "30", "--training.warmup_steps", "5",
               "--optimizer.lr", "1e-2", "--training.batch_size", "4", "--training.document_mask",
               "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000", "--checkpoint.model_weights_only",
               "--job.dump_folder", str(tmp_path / "out")])
    out, err = generate_here(capsys, "--checkpoint", tmp_path / "out" / "checkpoint", "--chat", "--prompt",
                             CHAT[0]["content"], "--max-new-tokens", "20")
    assert out.strip() == CHAT[0]["content"] + CHAT[1]["content"]
    # The reply's tokens and <|im_end|>: generation stopped there, 20 tokens were allowed.
    from torchtitan.datasets.tokenizer import tokenizer_from_file

    tokenizer = tokenizer_from_file(str(REPO_ROOT / "torchtitan" / "assets" / "chat_tokenizer"))
    assert f"generated {len(tokenizer.encode(CHAT[1]['content'], bos=False, eos=False)) + 1} tokens" in err


@pytest.mark.parametrize("args,expected", [
    (["--prompt", "x", "--system", "be brief"], "error: --system and --chat-template need --chat"),
    (["--prompt", "x", "--chat"], "error: --chat: chat data needs a Hugging Face tokenizer (a tokenizer.json, or the "
                                  "folder holding it with its tokenizer_config.json) in --tokenizer, not {}"),
])
def test_chat_mistakes_are_one_line(capsys, trained, args, expected):
    status, err = run_main(capsys, "--checkpoint", str(trained), *args)
    assert status == 2 and err.strip() == expected.format(TIKTOKEN)


def test_a_base_for_a_checkpoint_without_adapters_is_one_line(capsys, trained):
    status, err = run_main(capsys, "--checkpoint", str(trained), "--prompt", "x", "--base", "/nowhere",
                           "--max-new-tokens", "4")
    assert status == 2 and err.count("\n") == 1 and "error: --base names the base model of a LoRA checkpoint; " in err
