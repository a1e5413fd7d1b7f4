"""Weights made by scripts/convert_checkpoint.py are first-class checkpoints, for every family with an HFAdapter.

Tiny random transformers models (Llama, Qwen3, gpt-oss) of the `tiny` flavors' shapes are built in this
process and saved with `save_pretrained` (no hub), converted with hf-to-dcp, and then: generate.py
gives transformers' logits and greedy tokens, a run's fit check accepts them for their flavor and
refuses them for another (or for another head layout) in one line naming both models, and dcp-to-hf
gives back the same tensors. The same through dcp-to-torch and torch-to-dcp --flavor, which checks the
flavor against the weights. The training runs themselves: tests/integration/test_converted_training.py.
"""

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from scripts import convert_checkpoint  # noqa: E402
from scripts import generate as generate_script  # noqa: E402
from tests.tolerances import assert_reordered, transformer_sums  # noqa: E402
from torchtitan.checkpoint.fit import FitCheck, ModelRecord, checkpoint_record, tied_aliases  # noqa: E402
from torchtitan.checkpoint.folders import CheckpointError, Manifest  # noqa: E402
from torchtitan.checkpoint.model_args import args_record  # noqa: E402
from torchtitan.checkpoint.safe_load import read_metadata  # noqa: E402
from torchtitan.inference.generation import Sampling, generate  # noqa: E402
from torchtitan.models import get_train_spec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAMILIES = ["llama3", "qwen3", "gpt_oss"]
VOCAB = 2256  # the bundled tokenizer's: the vocabulary a run of the `tiny` flavor has
SEQ, NEW = 10, 6
# Ours against transformers' kernels: the sums of a forward of the `tiny` flavors (dim 128, hidden 512, head dim 8).
FORWARD_SUMS = transformer_sums(n_layers=2, dim=128, hidden=512, seq=SEQ, head_dim=8)


def run_args(family: str, flavor: str = "tiny", **changes):
    """The args of a run of `flavor` (its vocabulary the bundled tokenizer's)."""
    return dataclasses.replace(get_train_spec(family).config[flavor], vocab_size=VOCAB, **changes)


def reference(folder: Path, family: str, **changes) -> torch.nn.Module:
    """A random transformers model of the `tiny` flavor's shapes (with `changes`), saved in `folder`."""
    spec = get_train_spec(family)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(spec.hf_adapter.hf_config(run_args(family, **changes), "float32")))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # attention far from uniform (RoPE matters), norms not all ones
        for name, param in model.named_parameters():
            param.copy_(torch.rand(param.shape, generator=g) + 0.5 if name.endswith("norm.weight")
                        else torch.randn(param.shape, generator=g) * 0.2)
    model.save_pretrained(folder)
    return model


def convert(*args) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main([str(a) for a in args]) == 0


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def assert_generates_like(checkpoint: Path, hf: torch.nn.Module) -> None:
    """generate.py's model of `checkpoint` gives `hf`'s logits, and its greedy tokens."""
    source = generate_script.find_source(str(checkpoint))
    model = generate_script.build_model(source, SEQ + NEW, torch.device("cpu"), torch.float32).eval()
    with torch.no_grad():
        assert_reordered(model(tokens()), hf(tokens()).logits, FORWARD_SUMS)
        ours = torch.stack(list(generate(model, tokens().tolist(), NEW, Sampling(), eos_id=None)), dim=1)
        theirs = hf.generate(tokens(), attention_mask=torch.ones_like(tokens()), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, SEQ:]
    # Equal greedy tokens: these seeded references' top two logits are at least 1.5e-3 apart at every
    # step, a hundred times the two implementations' measured difference (1e-5).
    assert ours.tolist() == theirs.tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    """(family, the reference model, its folder, its hf-to-dcp conversion). No --model: the family
    whose reader takes config.json's architecture is found."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    hf = reference(root / "hf", family)
    convert("hf-to-dcp", root / "hf", root / "dcp")
    return family, hf, root / "hf", root / "dcp"


def test_hf_to_dcp_records_the_model_as_registered(converted):
    family, _, folder, ckpt = converted
    manifest = Manifest.read(ckpt)
    assert manifest.model == {"name": family, "flavor": "tiny"}  # its shapes and computation are the flavor's
    assert manifest.converted_from == str(folder)
    args = run_args(family)
    assert {k: manifest.model_args[k] for k in ("dim", "n_layers", "n_heads", "vocab_size", "rope_theta")} == \
        {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "vocab_size", "rope_theta")}
    tied = getattr(args, "tie_word_embeddings", False)  # gpt-oss has no tied flavor
    assert manifest.tied == ({"output.weight": "tok_embeddings.weight"} if tied else {})


def test_a_converted_folder_generates_the_reference_logits_and_tokens(converted):
    _, hf, _, ckpt = converted
    assert_generates_like(ckpt, hf)


def fit(ckpt: Path, family: str, flavor: str, args) -> list[str]:
    """What a run of `args` (as `flavor`) decides about loading `ckpt`: its warnings, or CheckpointError."""
    with torch.device("meta"):
        model = get_train_spec(family).model_cls.from_model_args(args)
    ours = ModelRecord(family, flavor, args_record(args), tied_aliases(model))
    check = FitCheck(str(ckpt), read_metadata(str(ckpt)), checkpoint_record(Manifest.read(ckpt)), ours, ["model"], [],
                     False)
    mine = check.report({f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}, separate_copies=False)
    return check.decide([check.shareable(mine)], mine).warnings


def test_a_run_of_its_flavor_loads_it_and_a_run_of_another_is_refused_naming_both(converted):
    family, _, _, ckpt = converted
    assert fit(ckpt, family, "tiny", run_args(family)) == []
    with pytest.raises(CheckpointError) as e:
        fit(ckpt, family, "debugmodel", run_args(family, "debugmodel"))
    line = str(e.value)
    assert line.startswith(f"checkpoint {ckpt} (written by {family} tiny) does not fit {family} debugmodel: ")
    assert "(dim 128 vs 256, " in line and "\n" not in line


def test_another_head_layout_of_the_same_shapes_is_refused(tmp_path):
    """dim 128 as 8 query and 4 key/value heads of 16 has every tensor shape of llama3 tiny's 16 and
    8 heads of 8: only the recorded args tell, and the rows are ordered per head."""
    reference(tmp_path / "hf", "llama3", n_heads=8, n_kv_heads=4)
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "dcp")
    assert Manifest.read(tmp_path / "dcp").model["flavor"] == "hf"  # no registered flavor
    with pytest.raises(CheckpointError, match=r"^checkpoint .* \(written by llama3 hf\) does not fit llama3 tiny: its "
                                              r"attention heads are laid out differently \(n_heads 8 \(checkpoint\) vs "
                                              r"16 \(this run\), n_kv_heads 4 \(checkpoint\) vs 8 \(this run\)\)"):
        fit(tmp_path / "dcp", "llama3", "tiny", run_args("llama3"))


def test_a_computation_no_shape_shows_is_refused(tmp_path):
    """Qwen3-MoE experts per token: a run choosing 4 of 8 would compute another model."""
    reference(tmp_path / "hf", "qwen3", num_experts=8, top_k=2, moe_hidden_dim=32)
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "dcp")
    with pytest.raises(CheckpointError, match=r"the model it was converted from computes otherwise: top_k 2 "
                                              r"\(checkpoint\) vs 4 \(this run\); use the model.flavor"):
        fit(tmp_path / "dcp", "qwen3", "hf", run_args("qwen3", num_experts=8, top_k=4, moe_hidden_dim=32))


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in safetensors_torch.load_file(f).items()}


def test_dcp_to_hf_gives_back_the_same_tensors(converted, tmp_path):
    _, _, folder, ckpt = converted
    convert("dcp-to-hf", ckpt, tmp_path / "out", "--fresh-layout")
    back, original = safetensors_of(tmp_path / "out"), safetensors_of(folder)
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


def test_torch_to_dcp_with_its_flavor_generates_and_exports_like_the_reference(converted, tmp_path):
    family, hf, _, ckpt = converted
    convert("dcp-to-torch", ckpt, tmp_path / "model.pt")
    convert("torch-to-dcp", tmp_path / "model.pt", tmp_path / "dcp", "--model", family, "--flavor", "tiny")
    manifest = Manifest.read(tmp_path / "dcp")
    assert manifest.model == {"name": family, "flavor": "tiny"} and manifest.model_args["vocab_size"] == VOCAB
    assert_generates_like(tmp_path / "dcp", hf)
    # No original config.json kept here: the export's comes from the recorded args.
    convert("dcp-to-hf", tmp_path / "dcp", tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, hf(tokens()).logits, rtol=0, atol=1e-4)


def test_torch_to_dcp_refuses_a_flavor_the_weights_are_not(converted, tmp_path, capsys):
    family, _, _, ckpt = converted
    convert("dcp-to-torch", ckpt, tmp_path / "model.pt")
    status = convert_checkpoint.main(["torch-to-dcp", str(tmp_path / "model.pt"), str(tmp_path / "dcp"), "--model",
                                      family, "--flavor", "debugmodel"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and not (tmp_path / "dcp").exists()
    assert err.startswith(f"error: {tmp_path / 'model.pt'}: ") and ", but --flavor debugmodel implies [" in err
    assert err.endswith("; name the flavor that wrote the weights, or leave --flavor out")
