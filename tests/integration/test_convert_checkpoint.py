"""scripts/convert_checkpoint.py as users run it: HF <-> DCP round trips byte for byte, torch.save exports, exports
that transformers loads with their tokenizer and ordinary file modes, refusals."""

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scripts import convert_checkpoint
from tests.helpers import REPO_ROOT, TINY_RUN, read_setup, run_train
from tests.tolerances import assert_reordered, transformer_sums
from torchtitan.checkpoint import folders
from torchtitan.checkpoint.folders import Manifest
from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from torchtitan.checkpoint.weights import weights_manifest, write_weights
from torchtitan.models.llama import llama3_configs
from torchtitan.models.llama.model import Transformer

safetensors_torch = pytest.importorskip("safetensors.torch")
# DCP's notice on every single-process load (the script silences it in its own process).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCRIPT = REPO_ROOT / "scripts" / "convert_checkpoint.py"
TIKTOKEN_FILE = REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs" / "tokenizer.model"  # 2,256 tokens, bos 2000, eos 2001
SENTENCEPIECE_FILE = REPO_ROOT / "torchtitan" / "assets" / "stdlib_docs" / "sentencepiece.model"  # 2,256 pieces, bos 1, eos 2
# A Hugging Face tokenizer.json folder: 1,024 ids, no BOS, EOS 1023, pad 1021.
CHAT_TOKENIZER = REPO_ROOT / "torchtitan" / "assets" / "chat_tokenizer"
CHAT_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=2256, ffn=128)  # GQA, and an ffn no flavor formula gives
DEBUG = dict(dim=256, n_layers=8, n_heads=16, n_kv_heads=16, vocab=2256, ffn=768)  # llama3 debugmodel's shapes
TINY_LLAMA3 = dict(dim=128, n_layers=2, n_heads=16, n_kv_heads=8, vocab=2256, ffn=512)  # llama3 tiny's (TINY_RUN's)




def convert(*args, check: bool = True) -> subprocess.CompletedProcess:
    """Runs the script in its own process, as a user would (the round trips; other tests call main()
    in this process, since each interpreter start costs seconds of imports)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def convert_here(capsys, *args) -> tuple[int, str]:
    """Runs the script's main() in this process (no interpreter start-up) -> (exit status, stderr)."""
    status = convert_checkpoint.main([str(a) for a in args])
    return status, capsys.readouterr().err


def assert_one_error_line(status: int, stderr: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert status == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr


# ---------------------------------------------------------------------------------------------
# Fake Hugging Face checkpoints


def hf_tensors(dim, n_layers, n_heads, n_kv_heads, vocab, ffn, tie=False) -> dict[str, torch.Tensor]:
    head_dim = dim // n_heads
    shapes = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        shapes.update({p + "self_attn.q_proj.weight": (q, dim), p + "self_attn.k_proj.weight": (kv, dim),
                       p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, q),
                       p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
                       p + "mlp.down_proj.weight": (dim, ffn),
                       p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,)})
    shapes["model.norm.weight"] = (dim,)
    if not tie:
        shapes["lm_head.weight"] = (vocab, dim)
    g = torch.Generator().manual_seed(0)
    # Small weights and unit norms, so the model also trains sensibly from them.
    return {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
            for k, s in shapes.items()}


def hf_config(dim, n_layers, n_heads, n_kv_heads, vocab, ffn, tie=False) -> dict:
    """A config.json as transformers writes one (fields sorted, extra fields a converter must keep)."""
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": dim, "initializer_range": 0.02, "intermediate_size": ffn,
            "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "llama", "num_attention_heads": n_heads,
            "num_hidden_layers": n_layers, "num_key_value_heads": n_kv_heads, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": tie, "torch_dtype": "bfloat16", "transformers_version": "4.45.0",
            "use_cache": True, "vocab_size": vocab}


def current_layout(config: dict) -> dict:
    """The same config.json as transformers 5 writes it: RoPE under rope_parameters, `dtype` not `torch_dtype`."""
    config = dict(config)
    theta, scaling, dtype = config.pop("rope_theta"), config.pop("rope_scaling"), config.pop("torch_dtype")
    return {**config, "rope_parameters": {**scaling, "rope_theta": theta}, "dtype": dtype, "transformers_version": "5.0.0"}


def write_safetensors_by_hand(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A valid safetensors file laid out in insertion order with a padded header, unlike the
    library's own writer: the round trip must reproduce files whatever wrote them."""
    header, offset = {"__metadata__": {"format": "pt", "writer": "by hand"}}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def make_hf_folder(folder: Path, shards: int = 1, tie: bool = False, **shape) -> Path:
    tensors = hf_tensors(**shape, tie=tie)
    folder.mkdir()
    if shards == 1:
        safetensors_torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        names = list(tensors)
        parts = [names[k::shards] for k in range(shards)]
        files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        for k, (file, part) in enumerate(zip(files, parts)):
            if k == 0:
                safetensors_torch.save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
            else:
                write_safetensors_by_hand(folder / file, {n: tensors[n] for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": {n: files[k] for k, part in enumerate(parts) for n in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config(**shape, tie=tie), indent=2, sort_keys=True) + "\n")
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    return folder


def assert_ordinary_modes(folder: Path) -> None:
    """What any file the user creates gets (0644 / 0755 under the usual umask), never safetensors' 0600."""
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    for path in folder.rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o777 if path.is_dir() else 0o666) & ~umask, path


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def load_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    entries = {k: v for k, v in read_metadata(path).state_dict_metadata.items() if k.startswith("model.")}
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Path]:
    """A sharded HF folder (GQA) and its hf-to-dcp conversion, made once for the module."""
    root = tmp_path_factory.mktemp("sharded")
    hf_dir = make_hf_folder(root / "hf", shards=3, **TINY)
    convert("hf-to-dcp", hf_dir, root / "dcp")
    return hf_dir, root / "dcp"


def test_sharded_round_trip_is_byte_identical(sharded, tmp_path):
    hf_dir, ckpt = sharded
    assert folders.problem_with(str(ckpt)) is None
    manifest = Manifest.read(str(ckpt))
    assert manifest.weights_only and manifest.model == {"name": "llama3", "flavor": "hf"} and manifest.dtype == "bfloat16"
    assert "hf/files/config.json" in manifest.files and "hf/files/model.safetensors.index.json" in manifest.files
    convert("dcp-to-hf", ckpt, tmp_path / "back")
    original, back = files_of(hf_dir), files_of(tmp_path / "back")
    assert sorted(back) == sorted(original) and len(original) == 6
    for name, data in original.items():
        assert back[name] == data, f"{name} differs"


@pytest.mark.fast
def test_single_file_tied_round_trip_is_byte_identical(tmp_path):
    hf_dir = make_hf_folder(tmp_path / "hf", tie=True, **TINY)
    # In this process (the sharded round trip runs the script as a user would).
    assert convert_checkpoint.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "dcp")]) == 0
    weights = load_dcp_model(tmp_path / "dcp")
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])  # what our tied model loads
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert files_of(tmp_path / "back") == files_of(hf_dir)


def test_dcp_holds_our_layout(sharded):
    """q/k rows are un-permuted (interleaved RoPE pairs), everything else is stored as is."""
    hf_dir, ckpt = sharded
    weights, original = load_dcp_model(ckpt), hf_tensors(**TINY)
    assert len(weights) == len(original)
    wk, hf_wk = weights["layers.1.attention.wk.weight"], original["model.layers.1.self_attn.k_proj.weight"]
    head_dim = TINY["dim"] // TINY["n_heads"]
    # Row 1 of each head (its first pair's second member) is HF's row head_dim/2.
    assert torch.equal(wk[1], hf_wk[head_dim // 2]) and torch.equal(wk[head_dim + 1], hf_wk[head_dim + head_dim // 2])
    assert torch.equal(weights["layers.0.feed_forward.w1.weight"], original["model.layers.0.mlp.gate_proj.weight"])
    assert weights["layers.0.attention.wq.weight"].dtype == torch.bfloat16


def test_fresh_layout_holds_the_original_tensors(sharded, tmp_path, capsys):
    """...and the original folder's other files; config.json is the original one."""
    hf_dir, ckpt = sharded
    status, stderr = convert_here(capsys, "dcp-to-hf", ckpt, tmp_path / "fresh", "--fresh-layout", "--max-shard-size-mb", "0.4")
    assert status == 0, stderr
    out = tmp_path / "fresh"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    back = {}
    for shard in shards:
        back.update(safetensors_torch.load_file(out / shard))
    original = hf_tensors(**TINY)
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)
    assert json.loads((out / "config.json").read_text()) == hf_config(**TINY)
    assert (out / "generation_config.json").read_bytes() == (hf_dir / "generation_config.json").read_bytes()
    assert_ordinary_modes(out)


def test_fresh_config_from_a_flavor_with_dtype_change(tmp_path, capsys):
    """A checkpoint without the original files (here via torch.save) gets a config generated from
    its flavor and shapes; --dtype casts the weights."""
    model = {k: v.float() for k, v in load_dcp_model_from_hf(tmp_path, capsys, DEBUG).items()}
    torch.save(model, tmp_path / "model.pt")
    status, stderr = convert_here(capsys, "torch-to-dcp", tmp_path / "model.pt", tmp_path / "dcp2", "--flavor", "debugmodel")
    assert status == 0, stderr
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp2", tmp_path / "out", "--dtype", "bfloat16")
    assert status == 0, stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["intermediate_size"],
            config["vocab_size"], config["torch_dtype"]) == (256, 8, 16, 768, 2256, "bfloat16")
    back = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(back[k], v) for k, v in hf_tensors(**DEBUG).items())


def test_transformers_5_folder_round_trips_and_keeps_its_tokenizer_files(tmp_path, capsys):
    """A folder in today's config layout, with tokenizer files: byte-identical back, and a fresh layout
    (here forced by --dtype) keeps the tokenizer files and updates the `dtype` field it uses."""
    hf_dir = make_hf_folder(tmp_path / "hf", tie=True, **TINY)
    (hf_dir / "config.json").write_text(json.dumps(current_layout(hf_config(**TINY, tie=True)), indent=2) + "\n")
    shutil.copyfile(TIKTOKEN_FILE, hf_dir / "tokenizer.model")
    (hf_dir / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>"}\n')
    assert convert_here(capsys, "hf-to-dcp", hf_dir, tmp_path / "dcp")[0] == 0
    assert convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "back")[0] == 0
    assert files_of(tmp_path / "back") == files_of(hf_dir)
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "f32", "--dtype", "float32")
    assert status == 0, stderr
    out = tmp_path / "f32"
    assert sorted(files_of(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
                                     "tokenizer_config.json"]
    assert (out / "tokenizer.model").read_bytes() == TIKTOKEN_FILE.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config == {**current_layout(hf_config(**TINY, tie=True)), "dtype": "float32"}
    assert_ordinary_modes(out)


def test_export_of_a_run_loads_in_transformers_with_its_tokenizer(tmp_path, capsys):
    """A checkpoint with no HF origin (llama3 debugmodel, Llama 3.1 RoPE scaling, a training length of
    2048 below the original context of 8192) -> an HF folder that transformers loads without a warning,
    with our logits, the tokenizer file beside it and its bos/eos ids in config.json."""
    transformers = pytest.importorskip("transformers")
    from tests.unit_tests.test_hf_reference import reference_warnings

    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2256)
    model = Transformer(args).eval()
    model.init_weights()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    assert convert_here(capsys, "torch-to-dcp", tmp_path / "model.pt", tmp_path / "dcp", "--flavor", "debugmodel")[0] == 0
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "out", "--tokenizer", TIKTOKEN_FILE)
    assert status == 0, stderr
    out = tmp_path / "out"
    assert sorted(files_of(out)) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert (out / "tokenizer.model").read_bytes() == TIKTOKEN_FILE.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (2000, 2001, 65536)
    assert_ordinary_modes(out)
    with reference_warnings() as messages:
        reference = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert messages == []
    tokens = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # transformers' kernels against ours: every sum of the debug model's forward
        assert_reordered(reference(tokens).logits, model(tokens), transformer_sums(n_layers=8, dim=256, hidden=768, seq=16, head_dim=16))


def test_a_sentencepiece_tokenizer_is_copied_too(sharded, tmp_path, capsys):
    """Named as a bundled file, the way a run's model.tokenizer_path may name it."""
    _, ckpt = sharded
    status, stderr = convert_here(capsys, "dcp-to-hf", ckpt, tmp_path / "out", "--fresh-layout", "--tokenizer",
                                  "bundled:stdlib_docs/sentencepiece.model")
    assert status == 0, stderr
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == SENTENCEPIECE_FILE.read_bytes()
    # The original config.json is kept as it was: its token ids are the original tokenizer's.
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == hf_config(**TINY)


def load_dcp_model_from_hf(tmp_path: Path, capsys, shape: dict) -> dict[str, torch.Tensor]:
    status, stderr = convert_here(capsys, "hf-to-dcp", make_hf_folder(tmp_path / "hf", **shape), tmp_path / "dcp")
    assert status == 0, stderr
    return load_dcp_model(tmp_path / "dcp")


def test_torch_save_export_and_import(sharded, tmp_path, capsys):
    _, ckpt = sharded
    status, stderr = convert_here(capsys, "dcp-to-torch", ckpt, tmp_path / "model.pt")
    assert status == 0, stderr
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = load_dcp_model(ckpt)
    assert sorted(exported) == sorted(expected) and all(torch.equal(exported[k], expected[k]) for k in expected)
    status, stderr = convert_here(capsys, "torch-to-dcp", tmp_path / "model.pt", tmp_path / "back")
    assert status == 0, stderr
    assert folders.problem_with(str(tmp_path / "back")) is None
    back = load_dcp_model(tmp_path / "back")
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    status, _ = convert_here(capsys, "dcp-to-torch", ckpt, tmp_path / "model32.pt", "--dtype", "float32")
    assert status == 0 and torch.load(tmp_path / "model32.pt", weights_only=True)["norm.weight"].dtype == torch.float32


@pytest.mark.fast
def test_converted_weights_start_a_training_run(tmp_path, capsys):
    status, stderr = convert_here(capsys, "hf-to-dcp", make_hf_folder(tmp_path / "hf", **TINY_LLAMA3), tmp_path / "dcp")
    assert status == 0, stderr
    run_train([*TINY_RUN, "--training.steps", "1", "--training.warmup_steps", "1",
               "--checkpoint.initial_load_path", str(tmp_path / "dcp"), "--job.dump_folder", str(tmp_path / "run")])
    assert read_setup(tmp_path / "run")["initial_load"] == {"path": str(tmp_path / "dcp"), "weights_only": True,
                                                            "step": 0}


def test_a_hugging_face_tokenizer_travels_with_the_weights(tmp_path, capsys):
    """hf-to-dcp keeps the folder's tokenizer files (in hf/files/), dcp-to-hf puts them back; with no
    HF origin, --tokenizer naming a tokenizer.json folder copies its files by name and puts its ids in
    the generated config.json, and transformers reads the same ids from the export."""
    from torchtitan.datasets.tokenizer import tokenizer_from_file

    hf_dir = make_hf_folder(tmp_path / "hf", **TINY)
    for name in CHAT_FILES:
        shutil.copyfile(CHAT_TOKENIZER / name, hf_dir / name)
    assert convert_here(capsys, "hf-to-dcp", hf_dir, tmp_path / "dcp")[0] == 0
    assert all((tmp_path / "dcp" / "hf" / "files" / name).is_file() for name in CHAT_FILES)
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "back", "--fresh-layout")
    assert status == 0, stderr
    assert all((tmp_path / "back" / name).read_bytes() == (CHAT_TOKENIZER / name).read_bytes() for name in CHAT_FILES)

    args = dataclasses.replace(llama3_configs["tiny"], vocab_size=1024)
    torch.save(Transformer(args).state_dict(), tmp_path / "model.pt")
    assert convert_here(capsys, "torch-to-dcp", tmp_path / "model.pt", tmp_path / "run_dcp", "--flavor", "tiny")[0] == 0
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "run_dcp", tmp_path / "out", "--tokenizer",
                                  "bundled:chat_tokenizer")
    assert status == 0, stderr
    out = tmp_path / "out"
    assert sorted(files_of(out)) == ["config.json", "model.safetensors", *CHAT_FILES]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 1023, 1021)
    transformers = pytest.importorskip("transformers")
    text = "def f(x):\n    return x  # <|im_end|>"
    ids = transformers.AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer_from_file(str(out)).encode(text, bos=False, eos=False)


def test_a_run_from_a_converted_folder_uses_its_tokenizer(tmp_path, capsys):
    """model.tokenizer_path left at its default: the converted folder's tokenizer, said in one notice."""
    hf_dir = make_hf_folder(tmp_path / "hf", **{**TINY_LLAMA3, "vocab": 1024})
    for name in CHAT_FILES:
        shutil.copyfile(CHAT_TOKENIZER / name, hf_dir / name)
    assert convert_here(capsys, "hf-to-dcp", hf_dir, tmp_path / "dcp")[0] == 0
    result = run_train([*TINY_RUN, "--training.steps", "1", "--training.warmup_steps", "1",
                        "--checkpoint.initial_load_path", str(tmp_path / "dcp"), "--job.dump_folder", str(tmp_path / "run")])
    notices = [line for line in (result.stdout + result.stderr).splitlines() if "model.tokenizer_path is left at" in line]
    assert len(notices) == 1 and notices[0].endswith(
        f"notice: model.tokenizer_path is left at its default, so the tokenizer is the one checkpoint.initial_load_path "
        f"carries: {tmp_path / 'dcp' / 'hf' / 'files'}; set model.tokenizer_path to use another")


# ---------------------------------------------------------------------------------------------
# Refusals


class Exploit:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.fast
def test_torch_file_needing_arbitrary_unpickling_is_refused(tmp_path, capsys):
    exploit = Exploit()
    exploit.marker = tmp_path / "pwned"
    torch.save({"tok_embeddings.weight": torch.zeros(2), "payload": exploit}, tmp_path / "evil.pt")
    status, stderr = convert_here(capsys, "torch-to-dcp", tmp_path / "evil.pt", tmp_path / "out")
    assert_one_error_line(status, stderr, "needs arbitrary unpickling")
    assert "system" in stderr  # names what the file asked for
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pt"]


def _bad_inputs(tmp: Path) -> dict[str, tuple[list, str]]:
    hf = make_hf_folder(tmp / "hf", **TINY)
    no_config = make_hf_folder(tmp / "no_config", **TINY)
    (no_config / "config.json").unlink()
    yarn = make_hf_folder(tmp / "yarn", **TINY)
    (yarn / "config.json").write_text(json.dumps(current_layout({**hf_config(**TINY), "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}})))
    extra = make_hf_folder(tmp / "extra", **TINY)
    safetensors_torch.save_file({**hf_tensors(**TINY), "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
                                extra / "model.safetensors")
    (tmp / "notes").mkdir()
    (tmp / "taken").mkdir()
    (tmp / "taken" / "x").write_text("keep me")
    torch.save({"tok_embeddings.weight": torch.zeros(2), "vision.proj": torch.zeros(2)}, tmp / "foreign.pt")
    torch.save({"tok_embeddings.weight": torch.zeros(2), "layers.0.attention.wq.weight": torch.zeros(2)}, tmp / "part.pt")
    torch.save([torch.zeros(2)], tmp / "list.pt")
    with zipfile.ZipFile(tmp / "archive.pt", "w") as archive:
        archive.writestr("notes.txt", "a zip archive, but not torch.save's")
    weights = make_hf_folders(tmp)
    ckpt = tmp / "ckpt"
    assert convert_checkpoint.main(["hf-to-dcp", str(hf), str(ckpt)]) == 0  # with the original files (the sidecar)
    no_config = tmp / "ckpt_no_config"  # from torch-to-dcp without --flavor: nothing tells the head count
    assert convert_checkpoint.main(["dcp-to-torch", str(ckpt), str(tmp / "weights.pt")]) == 0
    assert convert_checkpoint.main(["torch-to-dcp", str(tmp / "weights.pt"), str(no_config)]) == 0
    damaged = {name: shutil.copytree(ckpt, tmp / f"ckpt_{name}") for name in ("metadata", "config", "gelu")}
    # Damaged in place, each file keeping its size, so the manifest cannot tell.
    replace_keeping_size(damaged["metadata"] / ".metadata", b"torch.distributed.checkpoint.", b"torch.distributed.checkpoinX.")
    config = damaged["config"] / "hf" / "files" / "config.json"
    config.write_text("[1]".ljust(config.stat().st_size))
    replace_keeping_size(damaged["gelu"] / "hf" / "files" / "config.json", b'"silu"', b'"relu"')
    empty = tmp / "ckpt_empty"
    write_weights({}, str(empty), weights_manifest({}, "llama3", "tiny"))
    return {
        "missing folder": (["hf-to-dcp", tmp / "nope", tmp / "out"], "does not exist"),
        "missing config.json": (["hf-to-dcp", no_config, tmp / "out"], "config.json not found"),
        "unsupported RoPE": (["hf-to-dcp", yarn, tmp / "out"], "config.json: rope_parameters rope_type 'yarn' is not supported"),
        "unknown tensor names": (["hf-to-dcp", extra, tmp / "out"], "not LlamaForCausalLM parameters: model.layers.0"),
        "output exists": (["hf-to-dcp", hf, tmp / "taken"], "already exists"),
        "missing checkpoint": (["dcp-to-torch", tmp / "nope", tmp / "out.pt"], "does not exist"),
        "HF folder as checkpoint": (["dcp-to-torch", hf, tmp / "out.pt"], "is not a checkpoint"),
        "empty folder as checkpoint": (["dcp-to-hf", tmp / "notes", tmp / "out"], "is not a checkpoint"),
        "unknown names in torch file": (["torch-to-dcp", tmp / "foreign.pt", tmp / "out"], "not Llama parameters: vision.proj"),
        "not a torch file": (["torch-to-dcp", hf / "config.json", tmp / "out"], "is not a torch.save file"),
        "bad dtype": (["dcp-to-hf", hf, tmp / "out", "--dtype", "int4"], "invalid choice: 'int4'"),
        # paths and names
        "file as HF folder": (["hf-to-dcp", hf / "config.json", tmp / "out"], f"Hugging Face folder {hf}/config.json is "
                                                                             "not a folder"),
        "output in a missing folder": (["hf-to-dcp", hf, tmp / "no" / "out"], f"the folder {tmp}/no for output "
                                                                            f"{tmp}/no/out does not exist"),
        "unknown model": (["hf-to-dcp", hf, tmp / "out", "--model", "gpt9"], "unknown --model 'gpt9'; registered: "),
        "unknown flavor": (["torch-to-dcp", tmp / "part.pt", tmp / "out", "--flavor", "huge"],
                           "unknown --flavor 'huge' for model 'llama3'; choose from "),
        "missing torch file": (["torch-to-dcp", tmp / "nope.pt", tmp / "out"], f"input file {tmp}/nope.pt does not exist"),
        "folder as torch file": (["torch-to-dcp", tmp / "notes", tmp / "out"], f"input {tmp}/notes is not a file"),
        # torch.save files
        "part of a model": (["torch-to-dcp", tmp / "part.pt", tmp / "out"], f"{tmp}/part.pt is not a whole Llama model: "
                                                                         "it lacks layers.0.attention.wk.weight and 9 more"),
        "zip archive as torch file": (["torch-to-dcp", tmp / "archive.pt", tmp / "out"],
                                      f"{tmp}/archive.pt is not a torch.save file (RuntimeError: "),
        "flavor the weights are not": (["torch-to-dcp", tmp / "weights.pt", tmp / "out", "--flavor", "tiny"],
                                       f"{tmp}/weights.pt: output.weight has shape [2256, 64], but --flavor tiny implies "
                                       "[2256, 128]; name the flavor that wrote the weights, or leave --flavor out"),
        "list as torch file": (["torch-to-dcp", tmp / "list.pt", tmp / "out"], "does not hold a state dict (a dict of "
                                                                             "parameter name -> tensor)"),
        # Hugging Face folders
        "config.json not JSON": (["hf-to-dcp", weights["bad_json"], tmp / "out"],
                                 f"config.json {weights['bad_json']}/config.json is not valid JSON (Expecting "),
        "index without weight_map": (["hf-to-dcp", weights["no_map"], tmp / "out"],
                                     f"{weights['no_map']}/model.safetensors.index.json has no weight_map"),
        "no weights": (["hf-to-dcp", weights["no_weights"], tmp / "out"],
                       "has neither model.safetensors nor model.safetensors.index.json"),
        "index names a missing file": (["hf-to-dcp", weights["lost_shard"], tmp / "out"],
                                       "the weight file model-00002-of-00002.safetensors named by "
                                       "model.safetensors.index.json is missing"),
        "bad header size": (["hf-to-dcp", weights["short"], tmp / "out"], "model.safetensors is not a safetensors file "
                                                                        "(bad header size)"),
        "bad header": (["hf-to-dcp", weights["garbage"], tmp / "out"], "model.safetensors is not a valid safetensors file ("),
        "stored twice": (["hf-to-dcp", weights["twice"], tmp / "out"], "tensor model.norm.weight is stored twice"),
        "more layers than config.json": (["hf-to-dcp", weights["one_layer"], tmp / "out"],
                                         "holds layers.1.attention.wk.weight, which config.json does not imply"),
        "other ffn than config.json": (["hf-to-dcp", weights["ffn"], tmp / "out"],
                                       "layers.0.feed_forward.w2.weight has shape [64, 128], but config.json implies "
                                       "[64, 96]"),
        # checkpoints
        "shard size": (["dcp-to-hf", ckpt, tmp / "out", "--max-shard-size-mb", "0"], "--max-shard-size-mb must be "
                                                                                   "positive, not 0.0"),
        "vocab size": (["dcp-to-hf", ckpt, tmp / "out", "--vocab-size", "0"], "--vocab-size 0 must be between 1 and the "
                                                                              "embedding's 2256 rows"),
        "no head count": (["dcp-to-hf", no_config, tmp / "out"], "the checkpoint's model llama3 unknown is not a registered "
                                                                 "flavor, so its head count is unknown; pass --n-heads"),
        "damaged metadata": (["dcp-to-torch", damaged["metadata"], tmp / "out.pt"], "its DCP metadata cannot be read "
                             "safely (refusing to load torch.distributed.checkpoinX.metadata.Metadata from a checkpoint's "
                             "metadata)"),
        "no model weights": (["dcp-to-torch", empty, tmp / "out.pt"], f"checkpoint {empty} holds no model weights"),
        "kept config.json no object": (["dcp-to-hf", damaged["config"], tmp / "out"], "/hf/files/config.json is not a "
                                                                                      "JSON object"),
        "kept config.json refused": (["dcp-to-hf", damaged["gelu"], tmp / "out"], "/hf/files/config.json: hidden_act "
                                                                                  "'relu' is not supported"),
    }


def replace_keeping_size(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))


def make_hf_folders(tmp: Path) -> dict[str, Path]:
    """HF folders with one thing wrong each."""
    bad = {name: make_hf_folder(tmp / name, **TINY) for name in ("bad_json", "no_map", "no_weights", "lost_shard", "short",
                                                                "garbage", "twice", "one_layer", "ffn")}
    (bad["bad_json"] / "config.json").write_text('{"hidden_size": 64,')
    (bad["no_map"] / "model.safetensors.index.json").write_text('{"metadata": {}}')
    (bad["no_weights"] / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    for name in ("lost_shard", "twice"):  # the norm is in the second file, which is missing, or holds it as well
        (bad[name] / "model.safetensors").rename(bad[name] / first)
        weight_map = {**dict.fromkeys(hf_tensors(**TINY), first), "model.norm.weight": second}
        (bad[name] / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    safetensors_torch.save_file({"model.norm.weight": torch.ones(64)}, bad["twice"] / second)
    (bad["short"] / "model.safetensors").write_bytes(b"\x08\x00\x00")
    header = b'{"x": no json}  '
    (bad["garbage"] / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (bad["one_layer"] / "config.json").write_text(json.dumps({**hf_config(**TINY), "num_hidden_layers": 1}))
    (bad["ffn"] / "config.json").write_text(json.dumps({**hf_config(**TINY), "intermediate_size": 96}))
    return bad


@pytest.mark.fast
def test_user_mistakes_are_one_line_and_write_nothing(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    before = files_of(tmp_path)
    for name, (args, expected) in cases.items():
        try:
            status, stderr = convert_here(capsys, *args)
        except SystemExit as e:  # argparse's own refusals leave through SystemExit
            status, stderr = e.code, capsys.readouterr().err
        assert_one_error_line(status, stderr, expected)
        assert files_of(tmp_path) == before, name
        assert not any(".partial-" in p.name for p in tmp_path.iterdir()), name


def test_tokenizer_mistakes_are_one_line(sharded, tmp_path, capsys):
    _, ckpt = sharded
    cases = {
        "missing": (["--tokenizer", tmp_path / "nope.model"], "--tokenizer " + str(tmp_path / "nope.model") + " does not exist"),
        "not a tokenizer": (["--tokenizer", REPO_ROOT / "pyproject.toml"], "is not a valid sentencepiece model"),
        "a folder without tokenizer.json": (["--tokenizer", REPO_ROOT / "docs"],
                                            f"--tokenizer {REPO_ROOT / 'docs'} is neither a file nor a folder holding "
                                            "tokenizer.json"),
        "not a tokenizer.json": (["--tokenizer", REPO_ROOT / "torchtitan" / "assets" / "chat_tokenizer" / "README.md"],
                                 "is not a valid sentencepiece model"),
        "a json file that is no tokenizer": (["--tokenizer", CHAT_TOKENIZER / "tokenizer_config.json"],
                                             'tokenizer_config.json is not a Hugging Face tokenizer.json: it has no "model" '
                                             "entry"),
        "bundled name not shipped": (["--tokenizer", "bundled:stdlib_docs/nope.model"],
                                     "--tokenizer 'bundled:stdlib_docs/nope.model': the torchtitan package ships no such file"),
        "larger than the model": (["--tokenizer", TIKTOKEN_FILE, "--vocab-size", "100"],
                                  "has 2256 tokens, more than the model's 100 embedding rows"),
    }
    for name, (args, expected) in cases.items():
        assert_one_error_line(*convert_here(capsys, "dcp-to-hf", ckpt, tmp_path / "out", *args), expected)
        assert not (tmp_path / "out").exists(), name


def test_missing_safetensors_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors` fail
    hf = make_hf_folder(tmp_path / "hf", **TINY)
    status, stderr = convert_here(capsys, "hf-to-dcp", hf, tmp_path / "out")
    assert_one_error_line(status, stderr, "safetensors package is not installed")
    assert not (tmp_path / "out").exists()


def test_a_kept_original_layout_is_never_contradicted(tmp_path, capsys):
    """--n-heads against the kept config.json, or a damaged sidecar: one line, nothing written."""
    hf = make_hf_folder(tmp_path / "hf", **TINY)
    assert convert_here(capsys, "hf-to-dcp", hf, tmp_path / "dcp")[0] == 0
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "out", "--n-heads", "8")
    assert_one_error_line(status, stderr, "--n-heads 8 contradicts the original config.json kept with the checkpoint (4)")
    layout = tmp_path / "dcp" / "hf" / "layout.json"  # damaged in place (same size, so the manifest cannot tell)
    layout.write_text("[1]".ljust(layout.stat().st_size))
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "out")
    assert_one_error_line(status, stderr, "layout.json is not a torchtitan-hf-sidecar-1 layout")
    assert not (tmp_path / "out").exists()


def test_a_damaged_kept_header_gives_a_fresh_layout_with_a_warning(tmp_path, capsys):
    hf = make_hf_folder(tmp_path / "hf", **TINY)
    assert convert_here(capsys, "hf-to-dcp", hf, tmp_path / "dcp")[0] == 0
    header = tmp_path / "dcp" / "hf" / "headers" / "model.safetensors.header"
    header.write_text("[1]".ljust(header.stat().st_size))  # same size: the manifest cannot tell
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "out")
    assert status == 0, stderr
    assert stderr.startswith("warning: writing a fresh layout, not the original files: the kept original layout cannot be "
                             "read (AttributeError: ") and len(stderr.strip().splitlines()) == 1
    back = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(hf_tensors(**TINY)) and all(torch.equal(back[k], v) for k, v in hf_tensors(**TINY).items())


def test_a_model_without_hf_adapter_is_one_line(tmp_path, capsys, monkeypatch):
    """A family registered without Hugging Face names (a custom_import one, say) cannot be checked or converted."""
    spec = dataclasses.replace(convert_checkpoint.get_train_spec("llama3"), hf_adapter=None)
    monkeypatch.setattr(convert_checkpoint, "get_train_spec", lambda name: spec)
    torch.save({}, tmp_path / "model.pt")
    status, stderr = convert_here(capsys, "torch-to-dcp", tmp_path / "model.pt", tmp_path / "out")
    assert_one_error_line(status, stderr, "model 'llama3' has no hf_adapter in its TrainSpec, so its weights cannot be "
                                          "checked or converted here")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE (the adapter itself: unit_tests/test_qwen3_hf.py)


def test_qwen3_moe_folder_round_trips_through_the_script(tmp_path, capsys):
    """A bf16 Qwen3-MoE folder as transformers' save_pretrained writes it (one tensor per expert,
    `num_local_experts`): stacked experts and a zero expert bias in the checkpoint, the same files back,
    and a fresh layout with the published tensor names."""
    from torchtitan.models import get_train_spec

    if get_train_spec("qwen3").hf_adapter is None:
        pytest.skip("the qwen3 TrainSpec registers no hf_adapter yet")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=2256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert convert_here(capsys, "hf-to-dcp", tmp_path / "hf", tmp_path / "dcp", "--model", "qwen3")[0] == 0
    weights = load_dcp_model(tmp_path / "dcp")
    assert weights["layers.1.moe.experts.w2"].shape == (8, 64, 32) and weights["layers.1.moe.experts.w2"].dtype == torch.bfloat16
    assert torch.equal(weights["layers.1.moe.expert_bias"], torch.zeros(8))
    assert convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "back")[0] == 0
    assert files_of(tmp_path / "back") == files_of(tmp_path / "hf")
    status, stderr = convert_here(capsys, "dcp-to-hf", tmp_path / "dcp", tmp_path / "fresh", "--fresh-layout")
    assert status == 0, stderr
    with safetensors_torch.safe_open(tmp_path / "fresh" / "model.safetensors", "pt") as fresh, \
            safetensors_torch.safe_open(tmp_path / "hf" / "model.safetensors", "pt") as original:
        assert sorted(fresh.keys()) == sorted(original.keys())
        assert all(torch.equal(fresh.get_tensor(k), original.get_tensor(k)) for k in original.keys())
