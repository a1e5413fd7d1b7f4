"""gpt-oss <-> Hugging Face `GptOssForCausalLM`: names, tensor layouts, config.json, MXFP4, and the reference.

Tiny random `GptOssForCausalLM`s are built in this process (no hub) with every feature that matters
on: banded blocks whose 5-position window the 12-token sequences outgrow, non-zero sinks, non-zero
biases everywhere (attention, router, experts), YaRN with and without `truncate`, a clamped SwiGLU.
Saved with `save_pretrained`, they must convert to our model with the reference's logits (eager
attention, float32), and our exports must load in transformers silently with our logits; greedy
generation must give transformers' `generate` tokens. MXFP4 folders as OpenAI publishes them
(experts' blocks and scales) import to the weights and logits of transformers' own dequantized load;
every config.json field and tensor this model cannot use is refused in one line naming it.
"""

import contextlib
import dataclasses
import io
import json
import math
from pathlib import Path

import pytest
import torch

from scripts import convert_checkpoint
from tests.tolerances import largest_difference, transformer_sums
from torchtitan.checkpoint import hf_folder
from torchtitan.checkpoint.folders import Manifest
from torchtitan.errors import CheckpointError
from torchtitan.models import get_train_spec, hf_experts
from torchtitan.models.gpt_oss import gpt_oss_configs, hf_format
from torchtitan.models.gpt_oss.hf_adapter import GptOssHFAdapter
from torchtitan.models.gpt_oss.model import GptOss, GptOssModelArgs, YarnRope

ADAPTER = GptOssHFAdapter()
SEQ, VOCAB, WINDOW = 12, 97, 5
# YaRN over an original context of 16 stretched to 64 positions (factor 64 / 16, so transformers
# does not warn about an implicit factor), theta not transformers' default.
YARN = YarnRope(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, truncate=False)
# 4 heads of 16 dims over 2 key/value heads, 4 experts of width 32 of which 2 per token.
ARGS = GptOssModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_seq_len=64,
                       rope_theta=5000.0, rope_scaling=YARN, sliding_window=WINDOW, num_experts=4, top_k=2,
                       moe_hidden_dim=32)
# Ours against transformers' kernels: the sums of a forward (the experts' width, plus the router's
# over dim and the experts).
FORWARD_SUMS = transformer_sums(n_layers=2, dim=64, hidden=32 + 64 + 4, seq=SEQ, head_dim=16)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def logits_tolerance(expected: torch.Tensor) -> float:
    return largest_difference(torch.float32, FORWARD_SUMS, float(expected.abs().max()))


def _random_state(args: GptOssModelArgs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GptOss(args).state_dict().items()}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _one_line(call, expected: str) -> None:
    with pytest.raises(CheckpointError) as e:
        call()
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# Names and tensors


@pytest.mark.parametrize("bias", [True, False], ids=["attention-bias", "no-attention-bias"])
def test_every_name_maps_there_and_back(bias):
    args = dataclasses.replace(ARGS, attention_bias=bias)
    state = _random_state(args)
    assert sorted(ADAPTER.whole_model_names(state)) == sorted(state) == sorted(hf_format.param_names(2, bias))
    hf = hf_folder.to_hf(state, args, ADAPTER)
    for name in hf:
        assert all(f in state for f in ADAPTER.from_hf_names(name)), name
    for fqn in state:
        name = ADAPTER.to_hf_name(fqn)
        assert (name is None) == fqn.endswith("expert_bias") and (name is None or fqn in ADAPTER.from_hf_names(name))
    for bad in ("layers.0.moe.experts.w4", "layers.0.attention.q_norm.weight", "layers.x.ffn_norm.weight", "vision.x"):
        with pytest.raises(KeyError):
            ADAPTER.to_hf_name(bad)
    for bad in ("model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.gate_up_proj_zeros", "lm_head.bias", "model.layers.0.self_attn.sinks_scales"):
        with pytest.raises(KeyError):
            ADAPTER.from_hf_names(bad)


def test_hf_names_and_layouts_are_transformers():
    """One fused, transposed gate_up_proj per block with the gate in the even columns, as
    GptOssExperts computes `gate_up[..., ::2]`; down_proj transposed; sinks, router bias and every
    projection's bias under transformers' names; no expert_bias."""
    state = _random_state(ARGS)
    hf = hf_folder.to_hf(state, ARGS, ADAPTER)
    block = sorted(k.removeprefix("model.layers.1.") for k in hf if k.startswith("model.layers.1."))
    assert block == sorted([*(f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")), "self_attn.sinks",
                            "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.router.weight",
                            "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                            "mlp.experts.down_proj", "mlp.experts.down_proj_bias"])
    assert sorted(k for k in hf if not k.startswith("model.layers.")) == ["lm_head.weight", "model.embed_tokens.weight",
                                                                           "model.norm.weight"]
    p = "layers.1.moe.experts."
    gate_up, bias = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert gate_up.shape == (4, 64, 64) and torch.equal(gate_up[:, :, 0::2], state[p + "w1"].transpose(1, 2))
    assert torch.equal(gate_up[:, :, 1::2], state[p + "w3"].transpose(1, 2))
    assert torch.equal(bias[:, 0::2], state[p + "b1"]) and torch.equal(bias[:, 1::2], state[p + "b3"])
    assert torch.equal(hf["model.layers.1.mlp.experts.down_proj"], state[p + "w2"].transpose(1, 2))
    assert torch.equal(hf["model.layers.1.self_attn.sinks"], state["layers.1.attention.sinks"])
    assert torch.equal(hf["model.layers.1.mlp.router.bias"], state["layers.1.moe.router.gate.bias"])


@pytest.mark.parametrize("bias", [True, False], ids=["attention-bias", "no-attention-bias"])
def test_tensors_round_trip(bias):
    """Ours -> HF -> ours is the identity; the expert bias comes back as a fresh model's zeros."""
    args = dataclasses.replace(ARGS, attention_bias=bias)
    state = _random_state(args)
    back, _ = hf_folder.hf_to_ours(hf_folder.to_hf(state, args, ADAPTER), args, ADAPTER, "hf")
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], torch.zeros_like(tensor) if name.endswith("expert_bias") else tensor), name


def test_malformed_tensors_are_refused_in_one_line():
    hf = hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    _one_line(lambda: hf_folder.hf_to_ours({**hf, name: torch.zeros(3, 64, 64)}, ARGS, ADAPTER, "hf"),
              f"hf: {name} has shape [3, 64, 64], not one matrix for each of config.json's 4 experts")
    _one_line(lambda: hf_folder.hf_to_ours({**hf, name + "_bias": torch.zeros(64)}, ARGS, ADAPTER, "hf"),
              f"hf: {name}_bias has shape [64], not one vector for each of config.json's 4 experts")
    mixed = {**hf, name + "_blocks": torch.zeros(4, 64, 2, 16, dtype=torch.uint8),
             name + "_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}
    _one_line(lambda: hf_folder.hf_to_ours(mixed, ARGS, ADAPTER, "hf"),
              f"hf: {name} and {name}_blocks both hold layers.1.moe.experts.w1; keep one (dense or MXFP4)")
    _one_line(lambda: hf_folder.hf_to_ours({**hf, "model.layers.0.mlp.gate.weight": torch.zeros(1)}, ARGS, ADAPTER, "hf"),
              "hf holds tensors that are not GptOssForCausalLM parameters: model.layers.0.mlp.gate.weight")


def test_an_export_missing_one_part_of_a_fused_tensor_is_refused_in_one_line():
    state = {k: v for k, v in _random_state(ARGS).items() if k != "layers.0.moe.experts.w3"}
    _one_line(lambda: hf_folder.to_hf(state, ARGS, ADAPTER),
              "model.layers.0.mlp.experts.gate_up_proj is made of layers.0.moe.experts.w1, layers.0.moe.experts.w3, "
              "but the weights lack layers.0.moe.experts.w3")


# ---------------------------------------------------------------------------------------------
# MXFP4


def _e2m1(code: int) -> float:
    """An FP4 E2M1 code's value from its bits (sign, 2 exponent bits of bias 1, 1 mantissa bit;
    exponent 0 is subnormal), the format's definition rather than a table."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def _mxfp4(experts: int, rows: int, cols: int, g: torch.Generator, scales: tuple[int, int] = (119, 124)):
    """Random MXFP4 blocks and scales of `experts` matrices of `rows` x `cols` stored values."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(*scales, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)


def test_mxfp4_values_are_the_formats():
    """Each byte is two codes, low nibble first; each group of 32 values shares 2^(scale - 127);
    scales over the whole byte range (2^-127 is a float32 subnormal) are exact; results in the
    dtype asked for; chunks of any size give the same values."""
    g = torch.Generator().manual_seed(0)
    blocks, scales = _mxfp4(3, 5, 64, g, scales=(0, 255))
    got = hf_experts.dequantize_mxfp4(blocks, scales, "w_blocks", dtype=torch.float32)
    assert got.shape == (3, 5, 64) and got.dtype == torch.float32
    for e, r, c in ((0, 0, 0), (0, 0, 1), (1, 4, 33), (2, 3, 62), (2, 3, 63)):
        byte = int(blocks[e, r, c // 32, (c % 32) // 2])
        code = byte & 15 if c % 2 == 0 else byte >> 4
        assert got[e, r, c].item() == math.ldexp(_e2m1(code), int(scales[e, r, c // 32]) - 127), (e, r, c)
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).flatten(-2).long()  # (3, 5, 64)
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    powers = torch.tensor([math.ldexp(1.0, s - 127) for s in range(256)], dtype=torch.float64)
    expected = table[codes] * powers[scales.long()].repeat_interleave(32, dim=-1)
    assert torch.equal(got.double(), expected)
    assert torch.equal(hf_experts.dequantize_mxfp4(blocks, scales, "w_blocks"), expected.to(torch.bfloat16))
    odd = hf_experts.dequantize_mxfp4(blocks, scales, "w_blocks", torch.float32, rows=slice(1, None, 2))
    assert torch.equal(odd, got[:, 1::2])
    original = hf_experts._CHUNK_VALUES
    try:
        hf_experts._CHUNK_VALUES = 100  # fewer than a row: one row at a time
        assert torch.equal(hf_experts.dequantize_mxfp4(blocks, scales, "w_blocks", torch.float32), got)
    finally:
        hf_experts._CHUNK_VALUES = original
    meta = hf_experts.dequantize_mxfp4(blocks.to("meta"), scales.to("meta"), "w_blocks", rows=slice(0, None, 2))
    assert meta.is_meta and meta.shape == (3, 3, 64)


def _quantized_folder(hf: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """`hf` with its experts' matrices replaced by random MXFP4 blocks and scales, as OpenAI's files
    store them: the rows of the blocks are the dense tensor's last axis (gate_up_proj's interleaved
    columns, down_proj's dim)."""
    out = {}
    for name, w in hf.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = _mxfp4(w.shape[0], w.shape[2], w.shape[1], g)
        else:
            out[name] = w
    return out


def test_mxfp4_folders_import_dequantized():
    """w1 is the even stored rows of gate_up_proj's blocks, w3 the odd ones and w2 down_proj's, in
    bfloat16 (exact for MXFP4); the dense import of the same values gives the same model."""
    g = torch.Generator().manual_seed(1)
    quantized = _quantized_folder(hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER), g)
    ours, _ = hf_folder.hf_to_ours(quantized, ARGS, ADAPTER, "hf")
    dense = {}
    for name, t in quantized.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            dense[base] = hf_experts.dequantize_mxfp4(t, quantized[base + "_scales"], name).transpose(1, 2)
        elif not name.endswith("_scales"):
            dense[name] = t
    want, _ = hf_folder.hf_to_ours(dense, ARGS, ADAPTER, "hf")
    assert sorted(ours) == sorted(want)
    for name in want:
        assert torch.equal(ours[name], want[name]), name
    assert ours["layers.0.moe.experts.w1"].dtype == ours["layers.1.moe.experts.w2"].dtype == torch.bfloat16
    assert ours["layers.0.moe.experts.w1"].shape == (4, 32, 64) and ours["layers.0.moe.experts.w2"].shape == (4, 64, 32)


def test_malformed_mxfp4_tensors_are_refused_in_one_line():
    g = torch.Generator().manual_seed(2)
    quantized = _quantized_folder(hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER), g)
    p = "model.layers.1.mlp.experts."
    no_scales = {k: v for k, v in quantized.items() if k != p + "down_proj_scales"}
    _one_line(lambda: hf_folder.hf_to_ours(no_scales, ARGS, ADAPTER, "hf"),
              f"hf: {p}down_proj_blocks has no {p}down_proj_scales beside it (MXFP4 needs both)")
    no_blocks = {k: v for k, v in quantized.items() if k != p + "gate_up_proj_blocks"}
    _one_line(lambda: hf_folder.hf_to_ours(no_blocks, ARGS, ADAPTER, "hf"),
              f"hf: {p}gate_up_proj_scales has no {p}gate_up_proj_blocks beside it (MXFP4 needs both)")
    shapes = {**quantized, p + "down_proj_scales": quantized[p + "down_proj_scales"][:, :32]}
    _one_line(lambda: hf_folder.hf_to_ours(shapes, ARGS, ADAPTER, "hf"),
              f"hf: {p}down_proj_blocks [4, 64, 1, 16] and {p}down_proj_scales [4, 32, 1] are no MXFP4 pair")
    wide = {**quantized, p + "down_proj_blocks": torch.zeros(4, 64, 1, 32, dtype=torch.uint8)}
    _one_line(lambda: hf_folder.hf_to_ours(wide, ARGS, ADAPTER, "hf"), f"{p}down_proj_blocks [4, 64, 1, 32] and")
    floats = {**quantized, p + "down_proj_blocks": quantized[p + "down_proj_blocks"].float()}
    _one_line(lambda: hf_folder.hf_to_ours(floats, ARGS, ADAPTER, "hf"),
              f"hf: {p}down_proj_blocks and {p}down_proj_scales are float32 and uint8, not uint8 (MXFP4 codes and "
              "E8M0 scales)")


def test_a_run_reads_an_mxfp4_folder_directly(tmp_path):
    """checkpoint.initial_load_path (and generate.py, which loads the same way) naming an MXFP4 folder:
    the blocks and scales are checked on the meta device, then each rank dequantizes the experts it
    holds; the model is the one hf-to-dcp's import gives. A quantized tensor the family does not
    dequantize (uint8 under a dense name) is still refused in one line."""
    from torchtitan.checkpoint.hf_training import load_hf_weights, whole_model_shapes
    from torchtitan.checkpoint.states import ModelState

    hf = _quantized_folder(hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER), torch.Generator().manual_seed(5))
    hf_folder.write_fresh(str(tmp_path), hf, {**ADAPTER.hf_config(ARGS), "quantization_config": {"quant_method": "mxfp4"}},
                          10**9)
    want, _ = hf_folder.hf_to_ours(hf, ARGS, ADAPTER, "hf")
    model = GptOss(ARGS)
    with torch.device("meta"):
        whole = whole_model_shapes(GptOss(ARGS))
    load_hf_weights(str(tmp_path), ModelState([model]), ADAPTER, ARGS, whole, [], False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name].float()), name
    name = "model.layers.0.self_attn.sinks"
    hf_folder.write_fresh(str(tmp_path), {**hf, name: hf[name].to(torch.uint8)}, ADAPTER.hf_config(ARGS), 10**9)
    _one_line(lambda: load_hf_weights(str(tmp_path), ModelState([model]), ADAPTER, ARGS, whole, [], False),
              f"{tmp_path}: tensor {name} is stored as U8; weights are read from F64, F32, F16, BF16 only "
              "(dequantize the folder first)")


def test_a_runs_final_export_joins_the_fused_experts(tmp_path):
    """checkpoint.last_save_in_hf writes one parameter at a time: w1 and w3 wait for each other and
    leave as one gate_up_proj, the folder holding what the converter's export holds, and reading it
    back gives the model (expert_bias as a fresh model's zeros)."""
    from types import SimpleNamespace

    from torchtitan.checkpoint.hf_training import load_hf_weights, whole_model_shapes, write_hf_weights
    from torchtitan.checkpoint.states import ModelState

    state = _random_state(ARGS)
    model = GptOss(ARGS)
    model.load_state_dict(state)
    out = tmp_path / "step-1-hf"
    write_hf_weights(ModelState([model]), ADAPTER, ARGS, SimpleNamespace(world_mesh=None, pp_enabled=False), str(out),
                     torch.float32, {}, None, "attempt")
    written = hf_folder.read_hf_tensors(str(out), hf_folder.safetensors_files(str(out)))[0]
    expected = hf_folder.to_hf(state, ARGS, ADAPTER)
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
    back = GptOss(ARGS)
    with torch.device("meta"):
        whole = whole_model_shapes(GptOss(ARGS))
    load_hf_weights(str(out), ModelState([back]), ADAPTER, ARGS, whole, [], False)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, torch.zeros_like(tensor) if name.endswith("expert_bias") else state[name]), name


# ---------------------------------------------------------------------------------------------
# config.json

# As OpenAI published it (openai/gpt-oss-120b's config.json, as quoted in public test code; the
# 20B's differs in num_hidden_layers 24 and num_local_experts 32).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
GPT_OSS_20B = {**GPT_OSS_120B, "num_hidden_layers": 24, "num_local_experts": 32,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


@pytest.mark.parametrize("config,flavor", [(GPT_OSS_20B, "20B"), (GPT_OSS_120B, "120B")], ids=["20B", "120B"])
def test_openais_published_configs_read_as_their_flavors(config, flavor):
    assert ADAPTER.model_args_from_hf_config(config) == dataclasses.replace(gpt_oss_configs[flavor],
                                                                            max_seq_len=131072)


@pytest.mark.parametrize("flavor", list(gpt_oss_configs))
def test_config_round_trips_for_every_flavor(flavor):
    args = gpt_oss_configs[flavor]
    config = ADAPTER.hf_config(args)
    assert ADAPTER.model_args_from_hf_config(json.loads(json.dumps(config))) == args
    assert "quantization_config" not in config and config["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_other_settings_round_trip():
    """Plain RoPE, truncated YaRN, blocks banded otherwise than the default alternation, no attention
    bias, another SwiGLU clamp and gain, a padded vocabulary (written whole)."""
    cases = [dataclasses.replace(ARGS, rope_scaling=None),
             dataclasses.replace(ARGS, rope_scaling=dataclasses.replace(YARN, truncate=True), attention_bias=False,
                                 layer_types=("full_attention", "sliding_attention"), swiglu_limit=3.0,
                                 swiglu_alpha=1.5, norm_eps=0.05)]
    for args in cases:
        assert ADAPTER.model_args_from_hf_config(json.loads(json.dumps(ADAPTER.hf_config(args)))) == args
    padded = ADAPTER.hf_config(dataclasses.replace(ARGS, vocab_padding=3))
    assert padded["vocab_size"] == VOCAB + 3


def test_absent_fields_get_transformers_defaults():
    """GptOssConfig's: gpt-oss's YaRN (factor 32 over 4,096, untruncated) and theta 150,000, the even
    blocks banded to 128 positions, 128 experts of 2,880 of which 4 per token, biased attention; a
    YaRN dict without `truncate` truncates, as transformers computes it."""
    args = ADAPTER.model_args_from_hf_config({"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 16,
                                              "vocab_size": 10})
    assert (args.head_dim, args.n_kv_heads, args.num_experts, args.top_k, args.moe_hidden_dim, args.sliding_window,
            args.layer_types, args.attention_bias, args.max_seq_len, args.rope_theta, args.norm_eps) == (
        64, 8, 128, 4, 2880, 128, (), True, 131072, 150000.0, 1e-5)
    assert args.rope_scaling == YarnRope() and [args.layer_window(i) for i in range(3)] == [128, None, 128]
    assert (args.swiglu_limit, args.swiglu_alpha) == (7.0, 1.702)
    old = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10, "head_dim": None,
           "num_key_value_heads": None, "rope_theta": 1000.0, "max_position_embeddings": 256,
           "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}}
    args = ADAPTER.model_args_from_hf_config(old)
    assert (args.head_dim, args.n_kv_heads, args.rope_theta) == (16, 4, 1000.0)
    assert args.rope_scaling == YarnRope(factor=4.0, original_max_position_embeddings=64, truncate=True)


CFG = hf_format.hf_config(ARGS)
REFUSALS = {
    "tie_word_embeddings": ({"tie_word_embeddings": True}, "tie_word_embeddings true is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (this gpt-oss computes with 'silu')"),
    "attention_dropout": ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    "attention_bias": ({"attention_bias": "yes"}, "attention_bias 'yes' is not true or false"),
    "quant_method": ({"quantization_config": {"quant_method": "fp8"}},
                     "quantization_config quant_method 'fp8' is not supported (only OpenAI's MXFP4 experts"),
    "quantization_config": ({"quantization_config": "mxfp4"}, "quantization_config 'mxfp4' is not a JSON object"),
    "layer_types entry": ({"layer_types": ["sliding_attention", "chunked_attention"]},
                          "layer_types entry 'chunked_attention' is not supported"),
    "layer_types length": ({"layer_types": ["full_attention"]},
                           "layer_types ['full_attention'] is not a list of num_hidden_layers 2 entries"),
    "sliding_window": ({"sliding_window": None}, "sliding_window is null, but layer_types has sliding_attention"),
    "window size": ({"sliding_window": 0}, "sliding_window 0 is not a positive integer"),
    "experts disagree": ({"num_experts": 8}, "num_local_experts 4 and num_experts 8 disagree"),
    "top_k disagree": ({"experts_per_token": 3}, "num_experts_per_tok 2 and experts_per_token 3 disagree"),
    "top_k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts"),
    "kv heads": ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    "head_dim": ({"head_dim": 15}, "head_dim 15 is odd"),
    "swiglu_limit": ({"swiglu_limit": -1}, "swiglu_limit -1 is not a positive number"),
    "rope_type": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0}, "rope_scaling": None},
                  "rope_parameters rope_type 'llama3' is not supported"),
    "rope key": ({"rope_scaling": {**CFG["rope_scaling"], "low_freq_factor": 1.0}},
                 "rope_scaling key 'low_freq_factor' is not understood"),
    "attention_factor": ({"rope_parameters": {**CFG["rope_parameters"], "attention_factor": 1.2}},
                         "rope_parameters attention_factor 1.2 is not supported"),
    "mscale": ({"rope_parameters": {**CFG["rope_parameters"], "mscale": 1.0}},
               "rope_parameters mscale 1.0 is not supported"),
    "truncate": ({"rope_parameters": {**CFG["rope_parameters"], "truncate": "no"}},
                 "rope_parameters truncate 'no' is not true or false"),
    "scalings disagree": ({"rope_scaling": {**CFG["rope_scaling"], "truncate": True}},
                          "rope_parameters and rope_scaling describe different RoPE scalings"),
    "theta": ({"rope_theta": 10000.0}, "rope_theta 10000 and rope_parameters rope_theta 5000 disagree"),
    "model_type": ({"model_type": "gpt2"}, "model_type 'gpt2' is not gpt_oss"),
    "hidden_size": ({"hidden_size": None}, "config.json lacks hidden_size"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_fields_this_model_cannot_compute_are_refused_in_one_line(case):
    change, expected = REFUSALS[case]
    config = {**CFG, **change}
    if case == "hidden_size":
        del config["hidden_size"]
    _one_line(lambda: ADAPTER.model_args_from_hf_config(config), expected)


def test_malformed_configs_are_refused_in_one_line():
    _one_line(lambda: ADAPTER.model_args_from_hf_config(["not", "an", "object"]), "config.json does not hold a JSON object")
    _one_line(lambda: ADAPTER.hf_config(dataclasses.replace(ARGS, norm_type="layernorm")),
              "norm_type 'layernorm' has no GptOssForCausalLM equivalent (RMSNorm)")


def test_args_from_shapes_alone():
    for args in (ARGS, dataclasses.replace(ARGS, attention_bias=False)):
        shapes = {k: tuple(v.shape) for k, v in _random_state(args).items()}
        assert ADAPTER.args_with_shapes(args, shapes, None, None) == args
        got = ADAPTER.args_with_shapes(gpt_oss_configs["debugmodel"], shapes, 4, 2)
        assert (got.dim, got.n_heads, got.n_kv_heads, got.head_dim, got.n_layers, got.num_experts, got.moe_hidden_dim,
                got.vocab_size, got.attention_bias) == (64, 4, 2, 16, 2, 4, 32, VOCAB, args.attention_bias)
    _one_line(lambda: ADAPTER.args_with_shapes(ARGS, shapes, 8, None),
              "--n-heads 8 does not fit layer 0's 4 heads of 16 dims")
    _one_line(lambda: ADAPTER.args_with_shapes(dataclasses.replace(ARGS, top_k=5), shapes, None, None),
              "the weights hold 4 experts per block, fewer than the 5 per token of the flavor they claim")


def test_the_trainspec_registers_the_adapter():
    assert isinstance(get_train_spec("gpt_oss").hf_adapter, GptOssHFAdapter)
    assert hf_folder.family_of(GPT_OSS_20B) == ("gpt_oss", dataclasses.replace(gpt_oss_configs["20B"],
                                                                               max_seq_len=131072))


# ---------------------------------------------------------------------------------------------
# Against transformers


@pytest.fixture
def transformers():
    """transformers (the `test` extra), or the test is skipped; the tests above run without it."""
    pytest.importorskip("safetensors")
    return pytest.importorskip("transformers")


def tokens(length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform (RoPE and the window matter), norms not
    all ones, a sink per head of the scores' size, and every bias non-zero; router weights spread
    over several units so the experts chosen differ by token."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith("sinks") or "router" in name or "router.gate" in name:
                param.copy_(torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


# (YaRN truncate, layer_types, attention bias, swiglu limit and gain, rms_norm_eps); None: plain RoPE
REFERENCE_CASES = {
    "openai-yarn": (False, ("sliding_attention", "full_attention"), True, (7.0, 1.702), 1e-5),
    "truncated-yarn-full-first-no-attention-bias": (True, ("full_attention", "sliding_attention"), False, (2.0, 1.5),
                                                    0.05),
    "plain-rope": (None, ("sliding_attention", "full_attention"), True, (7.0, 1.702), 1e-5),
}


def case_args(case: str) -> GptOssModelArgs:
    truncate, kinds, bias, (limit, alpha), eps = REFERENCE_CASES[case]
    scaling = None if truncate is None else dataclasses.replace(YARN, truncate=truncate)
    return dataclasses.replace(ARGS, rope_scaling=scaling, layer_types=kinds if kinds[0] == "full_attention" else (),
                               attention_bias=bias, swiglu_limit=limit, swiglu_alpha=alpha, norm_eps=eps)


def reference_model(transformers, case: str):
    """A random transformers gpt-oss of `case`, eager attention (the reference kernel, sinks included)."""
    config = transformers.AutoConfig.for_model(**ADAPTER.hf_config(case_args(case), torch_dtype="float32"))
    model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager").float().eval()
    randomize_(model)
    return model


def convert(folder: Path) -> GptOss:
    """Our model from an HF folder, through the steps of `convert_checkpoint.py hf-to-dcp` (less the DCP save)."""
    args = ADAPTER.model_args_from_hf_config(hf_folder.read_json(str(folder / "config.json"), "config.json"))
    tensors, _ = hf_folder.read_hf_tensors(str(folder), hf_folder.safetensors_files(str(folder)))
    weights, _ = hf_folder.hf_to_ours(tensors, args, ADAPTER, str(folder))
    model = GptOss(args).eval()
    model.load_state_dict(weights)  # strict: every name, the expert biases included
    return model.float()


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_converted_reference_models_give_the_reference_logits(transformers, tmp_path, case):
    reference = reference_model(transformers, case)
    reference.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = reference(tokens()).logits
    model = convert(tmp_path)
    assert model.args == case_args(case)
    with torch.no_grad():
        diff = (model(tokens()) - expected).abs().max().item()
        print(f"max |logits difference| {case}: {diff:.2e} (largest logit {expected.abs().max():.2f})")
        assert diff <= logits_tolerance(expected)
        # The comparison sees the window and the sinks: without either, the logits move far beyond it.
        for block in model.layers.values():
            block.attention.window = None
        assert (model(tokens()) - expected).abs().max() > 100 * logits_tolerance(expected)
        model = convert(tmp_path)
        for block in model.layers.values():
            block.attention.sinks.fill_(-1e4)
        assert (model(tokens()) - expected).abs().max() > 100 * logits_tolerance(expected)


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_exports_load_in_transformers_silently_with_our_logits(transformers, tmp_path, case):
    """Ours -> HF folder (fresh layout, as dcp-to-hf writes one) -> transformers, silently and with our logits."""
    from tests.unit_tests.test_hf_reference import reference_warnings  # skips its module without transformers

    args = case_args(case)
    model = GptOss(args).eval()
    randomize_(model)
    hf_folder.write_fresh(str(tmp_path), hf_folder.to_hf(model.state_dict(), args, ADAPTER),
                          ADAPTER.hf_config(args, torch_dtype="float32"), 40_000)
    with reference_warnings() as messages:
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert messages == []
    assert type(reference).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        expected = reference(tokens()).logits
        diff = (model(tokens()) - expected).abs().max().item()
    print(f"max |logits difference| export {case}: {diff:.2e}")
    assert diff <= logits_tolerance(expected)


def test_greedy_generation_gives_transformers_tokens(transformers, tmp_path):
    """Our cached generation (the window and sinks in the caching kernel) against transformers'
    `generate`: 10-token prompts and 8 new tokens, twice the 5-position window past it."""
    from torchtitan.inference.generation import Sampling, generate

    reference = reference_model(transformers, "openai-yarn")
    reference.save_pretrained(tmp_path)
    model = convert(tmp_path)
    prompt, new = tokens(10), 8
    with torch.no_grad():
        ours = torch.stack(list(generate(model, prompt.tolist(), new, Sampling(), eos_id=None)), dim=1)
        out = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert ours.tolist() == out.sequences[:, 10:].tolist()
    # Equal tokens mean something only if no step's top two logits lie within the two models' difference.
    logits = torch.stack(out.logits, dim=1)
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    print(f"smallest top-two logit margin over the generated steps: {margin:.2e}")
    assert margin > 2 * logits_tolerance(logits)


def test_mxfp4_folders_import_as_transformers_dequantizes_them(transformers, tmp_path):
    """An MXFP4 folder as OpenAI publishes them (experts' blocks and scales, quantization_config):
    our dequantization equals transformers' own (integrations/mxfp4.py) tensor for tensor, and the
    imported model gives the logits of transformers' dequantized load of the same folder."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks, scales = _mxfp4(3, 6, 96, g, scales=(0, 256))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (experts, 96, 6): transposed
    ours = hf_experts.dequantize_mxfp4(blocks, scales, "x_blocks", dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())

    hf_dir = tmp_path / "hf"
    reference_model(transformers, "openai-yarn").save_pretrained(hf_dir)
    tensors, _ = hf_folder.read_hf_tensors(str(hf_dir), ["model.safetensors"])
    hf_folder.import_safetensors().torch.save_file(_quantized_folder(tensors, g), str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "quantization_config": GPT_OSS_120B["quantization_config"]}))
    reference = transformers.GptOssForCausalLM.from_pretrained(
        hf_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    model = convert(hf_dir)
    dense = reference.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(model.layers["1"].moe.experts.w3.data, dense[:, :, 1::2].transpose(1, 2))
    with torch.no_grad():
        expected = reference(tokens()).logits
        diff = (model(tokens()) - expected).abs().max().item()
    print(f"max |logits difference| MXFP4 import: {diff:.2e}")
    assert diff <= logits_tolerance(expected)


def _convert(*args) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return convert_checkpoint.main([str(a) for a in args])


def test_convert_script_round_trips_and_exports_mxfp4_folders_dense(transformers, tmp_path, capsys):
    """hf-to-dcp finds the family by itself; a dense folder comes back byte for byte (the fused
    gate_up_proj rebuilt from w1 and w3); an MXFP4 folder exports dense, in the dtype asked for, with
    no quantization_config, and transformers loads it with the dequantized model's logits."""
    hf_dir, ckpt, exact = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exact"
    reference = reference_model(transformers, "truncated-yarn-full-first-no-attention-bias")
    reference.save_pretrained(hf_dir)
    assert _convert("hf-to-dcp", hf_dir, ckpt) == 0
    assert Manifest.read(ckpt).model["name"] == "gpt_oss"
    assert _convert("dcp-to-hf", ckpt, exact) == 0
    assert sorted(p.name for p in exact.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    for path in hf_dir.iterdir():
        assert (exact / path.name).read_bytes() == path.read_bytes(), path.name

    mx_dir, mx_ckpt, out = tmp_path / "mx", tmp_path / "mx_ckpt", tmp_path / "out"
    reference_model(transformers, "openai-yarn").save_pretrained(mx_dir)
    tensors, _ = hf_folder.read_hf_tensors(str(mx_dir), ["model.safetensors"])
    quantized = _quantized_folder(tensors, torch.Generator().manual_seed(4))
    hf_folder.import_safetensors().torch.save_file(quantized, str(mx_dir / "model.safetensors"))
    config = json.loads((mx_dir / "config.json").read_text())
    (mx_dir / "config.json").write_text(json.dumps({**config, "quantization_config": GPT_OSS_120B["quantization_config"]}))
    assert _convert("hf-to-dcp", mx_dir, mx_ckpt) == 0
    capsys.readouterr()
    assert _convert("dcp-to-hf", mx_ckpt, tmp_path / "kept_dtype") == 0  # no --dtype: the original files were asked for
    assert capsys.readouterr().err == ("warning: writing a fresh layout, not the original files: the original files hold "
                                       "quantized weights (model.layers.0.mlp.experts.down_proj_blocks, U8), and "
                                       "exports are unquantized\n")
    assert _convert("dcp-to-hf", mx_ckpt, out, "--dtype", "float32") == 0
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and written["dtype"] == "float32"  # save_pretrained's spelling kept
    exported = hf_folder.read_hf_tensors(str(out), hf_folder.safetensors_files(str(out)))[0]
    assert not any(k.endswith(("_blocks", "_scales")) for k in exported)
    assert {t.dtype for t in exported.values()} == {torch.float32}
    name = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(exported[name], hf_experts.dequantize_mxfp4(quantized[name + "_blocks"],
                                                                   quantized[name + "_scales"], name).float().transpose(1, 2))
    dense = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    dequantized = transformers.GptOssForCausalLM.from_pretrained(
        mx_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(dense(tokens()).logits, dequantized(tokens()).logits)


# ---------------------------------------------------------------------------------------------
# The tokenizer a gpt-oss folder carries

# o200k's pre-tokenisation (tiktoken's o200k_base pat_str), the Split regex of gpt-oss's tokenizer.json.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# The harmony format's special tokens, in o200k_harmony's order (<|startoftext|> 199998 ... <|call|> 200012).
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
           "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
           "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>"]


def test_a_tokenizer_json_shaped_like_gpt_oss_reads_as_transformers_reads_it(tmp_path):
    """o200k_harmony itself cannot be fetched here, so a tiny byte-level BPE of its shape: the o200k
    split regex before a byte-level pre-tokenizer without its own regex, the harmony special tokens
    after the vocabulary, and OpenAI's roles in tokenizer_config.json (BOS <|startoftext|>, EOS
    <|return|>, padding <|endoftext|>, not the well-known guess that <|endoftext|> ends text). Our
    reader gives transformers' ids, text and roles, harmony-formatted text included."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from torchtitan.datasets.tokenizer import tokenizer_from_file

    corpus = Path(__file__).resolve().parents[2] / "torchtitan" / "assets" / "stdlib_docs" / "corpus.jsonl"
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:100]]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(O200K_PATTERN), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(HARMONY)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours = tokenizer_from_file(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.eos_id == bpe.token_to_id("<|return|>") and ours.n_words == bpe.get_vocab_size()
    texts = ["<|start|>user<|message|>What's 2+2? It's 4.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
             "Don't SHOUT, we'll see 12345 ÉLAN naïve 東京 👍🏽\n\n  def f(x):\n\treturn x/2  ", *docs[-10:]]
    for text in texts:
        ids = ours.encode(text, bos=False, eos=False)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text[:40]
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.encode("x<|call|>", bos=True, eos=True)[-2:] == [bpe.token_to_id("<|call|>"), ours.eos_id]
