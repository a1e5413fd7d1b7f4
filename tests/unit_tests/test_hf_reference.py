"""Converted Llamas against the reference implementation, Hugging Face `transformers`.

Tiny random `LlamaForCausalLM`s are built in this process and saved with `save_pretrained` (no hub),
their config.json rewritten into the current layout (`rope_parameters`) or the older one (top-level
`rope_theta` / `rope_scaling`); our converter reads them and our model must give the reference's
logits. The other way, our exports must load in transformers without a warning and give our logits.
"""

import contextlib
import dataclasses
import json
import logging
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.tolerances import assert_reordered, transformer_sums  # noqa: E402
from torchtitan.checkpoint import hf_folder  # noqa: E402
from torchtitan.models.llama import hf_format  # noqa: E402
from torchtitan.models.llama.hf_adapter import LlamaHFAdapter  # noqa: E402
from torchtitan.models.llama.model import ModelArgs, RopeScaling, Transformer  # noqa: E402

SEQ, VOCAB = 12, 97
# transformers' Llama and ours compute every sum of the forward in their own kernels (eager attention
# against SDPA, their norm and RoPE): the sums of a forward of these models (hidden size 160 or 192).
FORWARD_SUMS = transformer_sums(n_layers=2, dim=64, hidden=192, seq=SEQ, head_dim=16)
THETA = 500000.0  # not transformers' default of 10,000, so that a theta read from the wrong place shows
# With head_dim 16 and this theta the RoPE wavelengths are 6.3, 33, 168, 870, ... positions; an
# original context of 64 with frequency factors 1 and 4 keeps the first, blends the second and slows
# the rest, so all three branches of llama3 scaling matter within SEQ positions.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@contextlib.contextmanager
def reference_warnings() -> Iterator[list[str]]:
    """Collects what transformers warns about: its own logger at WARNING and above, and Python warnings."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("transformers"), Collect(level=logging.WARNING)
    level = logger.level
    # transformers' `warning_once` remembers what it said in this process; forget it, so that a
    # warning an earlier test already triggered is collected again here.
    getattr(getattr(logging.Logger, "warning_once", None), "cache_clear", lambda: None)()
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform (so RoPE matters) and norms not all
    ones (so swapped norms would show); a tied matrix is one parameter and drawn once."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def reference_folder(folder: Path, tie: bool, n_kv_heads: int, scaled: bool, layout: str) -> torch.Tensor:
    """Saves a random transformers Llama into `folder`, its RoPE settings in `layout` ("current" or
    "older"), and returns its logits for `tokens()`."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_theta=THETA, rope_scaling=dict(LLAMA3) if scaled else None)  # the older keywords: accepted by transformers 4 and 5
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_(model)
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        cfg.pop(key, None)
    if layout == "current":  # as transformers 5 writes it
        cfg["rope_parameters"] = {**(LLAMA3 if scaled else {"rope_type": "default"}), "rope_theta": THETA}
    else:  # as transformers 4 wrote it; the older `type` spelling inside rope_scaling
        scaling = {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
        cfg.update(rope_theta=THETA, rope_scaling=scaling if scaled else None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    with torch.no_grad():
        return model(tokens()).logits


def convert(folder: Path) -> Transformer:
    """Our model from an HF folder, through the steps of `convert_checkpoint.py hf-to-dcp` (less the DCP save)."""
    args = hf_format.model_args_from_hf_config(hf_folder.read_json(str(folder / "config.json"), "config.json"))
    tensors, _ = hf_folder.read_hf_tensors(str(folder), hf_folder.safetensors_files(str(folder)))
    weights, _ = hf_folder.hf_to_ours(tensors, args, LlamaHFAdapter(), str(folder))
    model = Transformer(args).eval()
    model.load_state_dict(weights)
    return model


CASES = [(tie, kv, scaled, layout) for tie in (False, True) for kv in (2, 4) for scaled in (False, True)
         for layout in ("current", "older")]


@pytest.mark.parametrize("tie,n_kv_heads,scaled,layout", CASES,
                         ids=[f"{'tied' if t else 'untied'}-{'gqa' if kv == 2 else 'mha'}-{'llama3' if s else 'plain'}-{lay}"
                              for t, kv, s, lay in CASES])
def test_converted_reference_models_give_the_reference_logits(tmp_path, tie, n_kv_heads, scaled, layout):
    expected = reference_folder(tmp_path, tie, n_kv_heads, scaled, layout)
    model = convert(tmp_path)
    assert model.args.rope_theta == THETA and (model.args.rope_scaling is not None) == scaled
    with torch.no_grad():
        assert_reordered(model(tokens()), expected, FORWARD_SUMS)


def test_the_comparison_sees_the_rope_settings(tmp_path):
    """What the converter computed before reading `rope_parameters` (theta 10,000, no scaling) is
    far from the reference here, so the test above can tell a misread config from a good one."""
    expected = reference_folder(tmp_path, tie=False, n_kv_heads=2, scaled=True, layout="current")
    model = convert(tmp_path)
    misread = Transformer(dataclasses.replace(model.args, rope_theta=10000.0, rope_scaling=None)).eval()
    misread.load_state_dict(model.state_dict())
    unscaled = Transformer(dataclasses.replace(model.args, rope_scaling=None)).eval()
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (misread(tokens()) - expected).abs().max() > 1e-2
        assert (unscaled(tokens()) - expected).abs().max() > 1e-2


EXPORTS = {
    "untied-gqa-plain": dict(tie_word_embeddings=False, n_kv_heads=2, rope_scaling=None),
    "tied-mha-plain": dict(tie_word_embeddings=True, n_kv_heads=None, rope_scaling=None),
    "untied-mha-llama3": dict(tie_word_embeddings=False, n_kv_heads=None,
                              rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64)),
    # Llama 3.2's scaling with a training length (max_seq_len) far below its original context of 8192:
    # the export transformers used to warn about.
    "tied-gqa-llama3.2": dict(tie_word_embeddings=True, n_kv_heads=2, rope_scaling=RopeScaling(factor=32.0)),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_exports_load_in_transformers_silently_with_our_logits(tmp_path, case):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=32, rope_theta=THETA, max_seq_len=SEQ,
                     **EXPORTS[case])
    model = Transformer(args).eval()
    randomize_(model)
    hf = hf_folder.to_hf(model.state_dict(), args, LlamaHFAdapter())
    if args.tie_word_embeddings:  # as dcp-to-hf does: HF stores a tied output projection only as the embedding
        hf.pop("lm_head.weight")
    hf_folder.write_fresh(str(tmp_path), hf, hf_format.hf_config(args, torch_dtype="float32"), 10**9)
    with reference_warnings() as messages:
        reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert messages == []
    assert reference.config.tie_word_embeddings == args.tie_word_embeddings
    with torch.no_grad():
        assert_reordered(reference(tokens()).logits, model(tokens()), FORWARD_SUMS)
