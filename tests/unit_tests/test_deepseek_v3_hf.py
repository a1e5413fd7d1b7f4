"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: names, tensor layouts, config.json, fp8, and the reference.

Tiny random `DeepseekV3ForCausalLM`s are built in this process (no hub): compressed and full
queries, YaRN and plain RoPE, a dense first block, 8 experts in 4 groups, non-zero
e_score_correction_bias (so the routing depends on it), rope_interleave true (DeepSeek's files)
and false (rotate_half rows, permuted by the converter). Saved with `save_pretrained`, they must
convert to our model with the reference's logits; our exports must load in transformers with our
logits. MTP modules travel under DeepSeek's names, fp8 block-scaled weights are dequantized, and
every config.json field this model cannot compute is refused in one line naming it.
"""

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from scripts import convert_checkpoint
from tests.tolerances import largest_difference, transformer_sums
from torchtitan.checkpoint import hf_folder, hf_training
from torchtitan.checkpoint.hf_training import whole_model_shapes
from torchtitan.errors import CheckpointError
from torchtitan.inference.generation import Sampling, generate
from torchtitan.models.deepseek_v3 import deepseek_v3_configs, hf_format
from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from torchtitan.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3ModelArgs, YarnScaling
from torchtitan.models.hf_adapter import rope_rows_to_hf

ADAPTER = DeepSeekV3HFAdapter()
SEQ, VOCAB = 12, 101
YARN = YarnScaling(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=0.8)
# 4 heads of 16 + 8 query/key dims and 12 value dims; 8 experts in 4 groups of which 2 usable, 2 per token.
ARGS = DeepSeekV3ModelArgs(dim=64, n_layers=3, n_dense_layers=1, n_heads=4, hidden_dim=96, vocab_size=VOCAB,
                           max_seq_len=64, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=12, rope_theta=5000.0, rope_scaling=YARN, num_experts=8, n_shared_experts=1,
                           top_k=2, moe_hidden_dim=32, score_func="sigmoid", n_group=4, topk_group=2, route_scale=2.5,
                           mtp_depth=0)
FULL_Q = dataclasses.replace(ARGS, q_lora_rank=0, rope_scaling=None, n_group=1, topk_group=1)
MTP = dataclasses.replace(ARGS, mtp_depth=2)
# Ours against transformers' kernels: the sums of a forward of ARGS (hidden size 96, plus the router's
# over dim and the 8 experts, plus the low-rank projections' 24; the queries' head dim 24).
FORWARD_SUMS = transformer_sums(n_layers=3, dim=64, hidden=96 + 64 + 8 + 24, seq=SEQ, head_dim=24)
# Our cached generation against transformers': those sums plus, per block, the latent space's (the
# queries' absorption over qk_nope_head_dim, the scores over kv_lora_rank + qk_rope_head_dim, the
# values' W_UV over kv_lora_rank: torchtitan/inference/generation.py).
GENERATION_SUMS = FORWARD_SUMS + ARGS.n_layers * (ARGS.qk_nope_head_dim + 2 * ARGS.kv_lora_rank + ARGS.qk_rope_head_dim)


def logits_tolerance(expected: torch.Tensor) -> float:
    return largest_difference(torch.float32, FORWARD_SUMS, float(expected.abs().max()))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _random_state(args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DeepSeekV3(args).state_dict().items()}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _rotate_half(args: DeepSeekV3ModelArgs) -> hf_format.RotateHalfArgs:
    return hf_format.RotateHalfArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


# ---------------------------------------------------------------------------------------------
# Names and tensors


@pytest.mark.parametrize("args", [ARGS, FULL_Q, MTP], ids=["lora-q", "full-q", "mtp"])
def test_every_name_maps_there_and_back(args):
    state = _random_state(args)
    assert sorted(ADAPTER.whole_model_names(state)) == sorted(state) == sorted(hf_format.param_names(args))
    hf = hf_folder.to_hf(state, args, ADAPTER)
    for name in hf:
        fqns = ADAPTER.from_hf_names(name, args)
        assert all(f in state for f in fqns), name
    for fqn in state:
        ADAPTER.to_hf_name(fqn)  # a name of the family (KeyError otherwise)
    for bad in ("layers.0.moe.experts.w4", "layers.0.attention.wk.weight", "mtp.0.block.eh_proj.weight", "vision.x"):
        with pytest.raises(KeyError):
            ADAPTER.to_hf_name(bad)
    for bad in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate.bias", "model.layers.3.enorm.bias",
                "model.layers.0.self_attn.q_proj.bias_scale_inv", "lm_head.bias"):
        with pytest.raises(KeyError):
            ADAPTER.from_hf_names(bad, MTP)


def test_hf_names_are_those_of_deepseeks_files():
    """A dense first block, MoE blocks with the bias as e_score_correction_bias and one tensor per
    expert, and MTP module k as layer num_hidden_layers + k with its copies of embedding and head."""
    state = _random_state(MTP)
    hf = hf_folder.to_hf(state, MTP, ADAPTER)

    def layer(i: int) -> list[str]:
        return sorted(k.removeprefix(f"model.layers.{i}.") for k in hf if k.startswith(f"model.layers.{i}."))

    attention = [f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                    "kv_a_layernorm", "kv_b_proj", "o_proj")]
    norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    assert layer(0) == sorted([*attention, *norms, *(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))])
    moe = sorted([*attention, *norms, "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                  *(f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
                  *(f"mlp.experts.{j}.{p}.weight" for j in range(8) for p in ("gate_proj", "up_proj", "down_proj"))])
    assert layer(2) == moe
    mtp = sorted([*moe, "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "shared_head.head.weight", "embed_tokens.weight"])
    assert layer(3) == layer(4) == mtp and layer(5) == []
    assert torch.equal(hf["model.layers.4.embed_tokens.weight"], state["tok_embeddings.weight"])
    assert torch.equal(hf["model.layers.3.shared_head.head.weight"], state["output.weight"])
    assert torch.equal(hf["model.layers.4.shared_head.norm.weight"], state["mtp.1.norm.weight"])
    assert torch.equal(hf["model.layers.3.mlp.gate.e_score_correction_bias"], state["mtp.0.block.moe.expert_bias"])
    assert torch.equal(hf["model.layers.1.mlp.experts.5.down_proj.weight"], state["layers.1.moe.experts.w2"][5])


@pytest.mark.parametrize("args", [ARGS, FULL_Q, MTP, _rotate_half(MTP), _rotate_half(FULL_Q)],
                         ids=["lora-q", "full-q", "mtp", "mtp-rotate-half", "full-q-rotate-half"])
def test_tensors_round_trip(args):
    """Ours -> HF -> ours is the identity, MTP modules and the expert bias included; the MTP layers'
    copies of the embedding and head are read as nothing."""
    state = _random_state(args)
    hf = hf_folder.to_hf(state, args, ADAPTER)
    back, _ = hf_folder.hf_to_ours(hf, args, ADAPTER, "hf")
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_rotate_half_folders_permute_only_the_rope_rows():
    """rope_interleave false: per head, the last qk_rope_head_dim query rows, and the last
    qk_rope_head_dim rows of kv_a_proj_with_mqa, go from adjacent pairs to halves; nothing else moves."""
    args = _rotate_half(ARGS)
    state = _random_state(args)
    hf, plain = hf_folder.to_hf(state, args, ADAPTER), hf_folder.to_hf(state, ARGS, ADAPTER)
    q = state["layers.0.attention.wq_b.weight"].view(4, 24, 24)
    got = hf["model.layers.0.self_attn.q_b_proj.weight"].view(4, 24, 24)
    assert torch.equal(got[:, :16], q[:, :16])
    assert torch.equal(got[:, 16:].reshape(32, 24), rope_rows_to_hf(q[:, 16:].reshape(32, 24), 4))
    kv = state["layers.0.attention.wkv_a.weight"]
    got = hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(got[:16], kv[:16]) and torch.equal(got[16:], torch.cat([kv[16::2], kv[17::2]]))
    moved = sorted(k for k in hf if not torch.equal(hf[k], plain[k]))
    assert moved == sorted(f"model.layers.{i}.self_attn.{p}.weight" for i in range(3)
                           for p in ("q_b_proj", "kv_a_proj_with_mqa"))


def test_missing_extra_and_mixed_experts_are_refused_in_one_line():
    hf = hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER)
    cases = {
        "missing": ({k: v for k, v in hf.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
                    "hf: model.layers.1.mlp.experts.3.up_proj.weight is missing (config.json has 8 experts)"),
        "beyond": ({**hf, "model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)},
                   "hf: model.layers.1.mlp.experts.8.gate_proj.weight is beyond config.json's 8 experts"),
        "mixed": ({**hf, "model.layers.1.mlp.experts.down_proj": torch.zeros(8, 64, 32)},
                  "both hold layers.1.moe.experts.w2; keep one layout of the experts"),
        "unknown": ({**hf, "model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1)},
                    "hf holds tensors that are not DeepseekV3ForCausalLM parameters: model.layers.0.mlp.shared_expert_gate"),
        "mtp beyond depth": ({**hf, "model.layers.3.enorm.weight": torch.zeros(64)},
                             "hf holds mtp.0.enorm.weight, which config.json does not imply"),
    }
    for case, (tensors, expected) in cases.items():
        with pytest.raises(CheckpointError) as e:
            ours, _ = hf_folder.hf_to_ours(tensors, ARGS, ADAPTER, "hf")
            convert_checkpoint._check_shapes(ours, ARGS, DeepSeekV3, "hf")
        assert expected in str(e.value) and "\n" not in str(e.value), case


def test_mtp_layers_config_json_promises_but_the_weights_lack_are_named_with_the_fix(tmp_path, caplog):
    """num_nextn_predict_layers 2 over weights without MTP layers (what save_pretrained writes, with 1): the
    converter and a run's (or generate.py's) Hugging Face load both lead with the fix, not a missing tensor."""
    hf = {k: v for k, v in hf_folder.to_hf(_random_state(MTP), MTP, ADAPTER).items() if not k.startswith("model.layers.3.")
          and not k.startswith("model.layers.4.")}
    promise = ("config.json promises 2 multi-token prediction layers model.layers.3-4 (num_nextn_predict_layers 2), but "
               "the weights hold none (transformers' save_pretrained writes num_nextn_predict_layers 1 without them); set "
               "num_nextn_predict_layers to 0 in config.json")
    with pytest.raises(CheckpointError) as e:
        hf_folder.hf_to_ours(hf, MTP, ADAPTER, "hf")
    assert str(e.value) == f"hf: {promise}"
    hf_folder.write_fresh(str(tmp_path), hf, ADAPTER.hf_config(MTP), 10**9)
    with torch.device("meta"):
        whole = whole_model_shapes(DeepSeekV3(MTP))
    with pytest.raises(CheckpointError) as e:
        hf_training.check_fits(str(tmp_path), ADAPTER, MTP, whole, [], False, option="--checkpoint")
    assert str(e.value) == f"--checkpoint {tmp_path}: {promise}"  # the fix alone: the tensors it lacks are the promise's
    with caplog.at_level(logging.WARNING):  # a partial load leaves the MTP modules as initialised, saying why first
        hf_training.check_fits(str(tmp_path), ADAPTER, MTP, whole, [], True)
    assert caplog.records[0].getMessage() == f"{tmp_path}: {promise}"


# ---------------------------------------------------------------------------------------------
# fp8


def _quantize(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as fp8 with a random scale per 128 x 128 block (partial blocks at the ends)."""
    rows, cols = w.shape
    scale = torch.rand((-(-rows // 128), -(-cols // 128)), generator=g) + 0.5
    full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_fp8_weights_are_dequantized_block_by_block():
    g = torch.Generator().manual_seed(0)
    q, scale = _quantize(torch.randn(200, 300, generator=g), g)
    got = hf_format.dequantize_fp8(q, scale)
    assert got.dtype == torch.bfloat16
    for i, j in ((0, 0), (1, 2), (0, 2), (1, 0)):  # each block has its own scale, the partial ones too
        block = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
        assert torch.equal(got[block], (q[block].float() * scale[i, j]).to(torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"^w_scale_inv has shape \[2, 2\], not \[2, 3\] for 128 x 128 blocks of a "
                                              r"200 x 300 weight$"):
        hf_format.dequantize_fp8(q, scale[:, :2], "w")


def test_fp8_folders_import_dequantized():
    """Every matrix of DeepSeek's fp8 files comes with a weight_scale_inv (experts and MTP included);
    the import is the dequantized model, and an fp8 matrix without its scale is refused."""
    args = MTP
    g = torch.Generator().manual_seed(1)
    hf = hf_folder.to_hf(_random_state(args), args, ADAPTER)
    quantized, expected = {}, {}
    for name, w in hf.items():
        if w.dim() == 2 and "embed_tokens" not in name and "head" not in name and "mlp.gate." not in name:
            q, scale = _quantize(w, g)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            expected[name] = hf_format.dequantize_fp8(q, scale)
        else:
            quantized[name] = expected[name] = w
    ours, _ = hf_folder.hf_to_ours(quantized, args, ADAPTER, "hf")
    want, _ = hf_folder.hf_to_ours(expected, args, ADAPTER, "hf")
    assert sorted(ours) == sorted(want)
    for name in want:
        assert torch.equal(ours[name], want[name]), name
    assert ours["mtp.1.block.moe.experts.w1"].dtype == torch.bfloat16
    quantized.pop("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv")
    with pytest.raises(CheckpointError, match=r"^hf: model.layers.1.mlp.experts.2.up_proj.weight is stored in "
                                              r"torch.float8_e4m3fn without its .*weight_scale_inv$"):
        hf_folder.hf_to_ours(quantized, args, ADAPTER, "hf")


def test_a_run_reads_an_fp8_folder_directly(tmp_path):
    """checkpoint.initial_load_path (and generate.py) naming an fp8 folder: each weight is dequantized
    with its scale as it is loaded, the model hf-to-dcp's import gives."""
    from torchtitan.checkpoint.hf_training import load_hf_weights
    from torchtitan.checkpoint.states import ModelState

    g = torch.Generator().manual_seed(3)
    quantized = {}
    for name, w in hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER).items():
        if "self_attn" in name and w.dim() == 2:
            quantized[name], quantized[name + "_scale_inv"] = _quantize(w, g)
        else:
            quantized[name] = w
    hf_folder.write_fresh(str(tmp_path), quantized, {**ADAPTER.hf_config(ARGS), "quantization_config":
                                                     DEEPSEEK_V3["quantization_config"]}, 10**9)
    want, _ = hf_folder.hf_to_ours(quantized, ARGS, ADAPTER, "hf")
    model = DeepSeekV3(ARGS)
    load_hf_weights(str(tmp_path), ModelState([model]), ADAPTER, ARGS, whole_model_shapes(DeepSeekV3(ARGS)), [], False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name].float()), name


# ---------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("flavor", [f for f in deepseek_v3_configs if deepseek_v3_configs[f].score_func == "sigmoid"])
def test_config_round_trips_for_every_sigmoid_flavor(flavor):
    args = deepseek_v3_configs[flavor]
    config = ADAPTER.hf_config(args)
    assert ADAPTER.model_args_from_hf_config(json.loads(json.dumps(config))) == args
    rotated = ADAPTER.model_args_from_hf_config({**config, "rope_interleave": False})
    assert isinstance(rotated, hf_format.RotateHalfArgs) and ADAPTER.hf_config(rotated)["rope_interleave"] is False


def test_softmax_routing_has_no_hf_config():
    args = dataclasses.replace(deepseek_v3_configs["16B"], score_func="softmax")  # DeepSeek-V2-Lite's routing
    with pytest.raises(CheckpointError, match=r"^score_func 'softmax' has no DeepseekV3ForCausalLM equivalent"):
        ADAPTER.hf_config(args)


# As DeepSeek published it (deepseek-ai/DeepSeek-V3, config.json; auto_map left out).
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
               "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
               "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
               "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
               "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
               "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]},
               "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                       "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
               "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
               "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_deepseeks_published_config_reads_as_the_671B_flavor():
    args = ADAPTER.model_args_from_hf_config(DEEPSEEK_V3)
    assert args == dataclasses.replace(deepseek_v3_configs["671B"], max_seq_len=163840)
    # transformers 5's layout of the same (rope_parameters, the MTP count under its other name) reads the same.
    current = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("rope_scaling", "rope_theta", "num_nextn_predict_layers")}
    current.update(rope_parameters={**DEEPSEEK_V3["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000.0},
                   num_mtp_layers=1)
    current["rope_parameters"].pop("type")
    assert ADAPTER.model_args_from_hf_config(current) == args


def test_absent_fields_get_transformers_defaults():
    args = ADAPTER.model_args_from_hf_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "vocab_size": 10, "q_lora_rank": None,
                                              "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 16}})
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim, args.num_experts, args.top_k, args.n_group,
            args.topk_group, args.route_scale, args.n_dense_layers, args.mtp_depth, args.max_seq_len) == (
        0, 512, 64, 256, 8, 8, 4, 2.5, 3, 1, 4096)
    # YaRN's factor defaults to max_position_embeddings / original; beta 32 and 1; no mscale.
    assert args.rope_scaling == YarnScaling(factor=256.0, original_max_position_embeddings=16, beta_fast=32.0,
                                            beta_slow=1.0, mscale=0.0, mscale_all_dim=0.0)


CFG = hf_format.hf_config(ARGS)
REFUSALS = {
    "tie_word_embeddings": ({"tie_word_embeddings": True}, "tie_word_embeddings true is not supported"),
    "scoring_func": ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    "topk_method": ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy' is not supported"),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
    "attention_bias": ({"attention_bias": True}, "attention_bias True is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    "num_key_value_heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2 is not num_attention_heads 4"),
    "quant_method": ({"quantization_config": {"quant_method": "bitsandbytes"}},
                     "quantization_config quant_method 'bitsandbytes' is not supported"),
    "weight_block_size": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
                          "quantization_config weight_block_size [64, 64] is not supported"),
    "rope_type": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0}, "rope_scaling": None},
                  "rope_parameters rope_type 'llama3' is not supported"),
    "attention_factor": ({"rope_parameters": {**CFG["rope_parameters"], "attention_factor": 1.2}},
                         "rope_parameters attention_factor 1.2 is not supported"),
    "truncate": ({"rope_parameters": {**CFG["rope_parameters"], "truncate": False}},
                 "rope_parameters truncate False is not supported"),
    "rope key": ({"rope_scaling": {**CFG["rope_scaling"], "low_freq_factor": 1.0}},
                 "rope_scaling key 'low_freq_factor' is not understood"),
    "scalings disagree": ({"rope_scaling": {**CFG["rope_scaling"], "factor": 8.0}},
                          "rope_parameters and rope_scaling describe different RoPE scalings"),
    "theta": ({"rope_theta": 10000.0}, "rope_theta 10000 and rope_parameters rope_theta 5000 disagree"),
    "rope_interleave": ({"rope_interleave": "yes"}, "rope_interleave 'yes' is not true or false"),
    "groups": ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
    "top_k": ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4 experts of topk_group 2 groups"),
    "model_type": ({"model_type": "deepseek_v2"}, "model_type 'deepseek_v2' is not deepseek_v3"),
    "hidden_size": ({"hidden_size": None}, "config.json lacks hidden_size"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_fields_this_model_cannot_compute_are_refused_in_one_line(case):
    change, expected = REFUSALS[case]
    config = {**CFG, **change}
    for key in [k for k, v in change.items() if v is None and k == "hidden_size"]:
        del config[key]
    with pytest.raises(CheckpointError) as e:
        ADAPTER.model_args_from_hf_config(config)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_args_from_shapes_alone():
    for args in (ARGS, FULL_Q, MTP):
        shapes = {k: tuple(v.shape) for k, v in _random_state(args).items()}
        assert ADAPTER.args_with_shapes(args, shapes, None, None) == args
        got = ADAPTER.args_with_shapes(deepseek_v3_configs["debugmodel"], shapes, 4, None)
        assert (got.dim, got.n_heads, got.q_lora_rank, got.kv_lora_rank, got.qk_nope_head_dim, got.qk_rope_head_dim,
                got.v_head_dim, got.n_layers, got.n_dense_layers, got.mtp_depth, got.moe_hidden_dim) == (
            64, 4, args.q_lora_rank, 16, 16, 8, 12, 3, 1, args.mtp_depth, 32)
    with pytest.raises(CheckpointError, match=r"^--n-heads 8 does not fit layer 0's 4 attention heads$"):
        ADAPTER.args_with_shapes(ARGS, shapes, 8, None)


# ---------------------------------------------------------------------------------------------
# Against transformers


@pytest.fixture
def transformers():
    """transformers (the `test` extra), or the test is skipped; the tests above run without it."""
    pytest.importorskip("safetensors")
    return pytest.importorskip("transformers")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform (so RoPE matters), norms not all ones,
    router weights spread over several units and a correction bias of the scores' size (so both
    decide which experts a token gets)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith("gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias") or name.endswith("expert_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=g) * 0.5)


# (q_lora_rank, YaRN, rope_interleave, norm_topk_prob, rms_norm_eps, n_group/topk_group)
REFERENCE_CASES = {
    "lora-yarn-interleaved": (24, True, True, True, 1e-6, (4, 2)),
    "full-q-plain-rotate-half": (None, False, False, True, 1e-6, (1, 1)),
    "lora-yarn-rotate-half-unnormalised-eps": (24, True, False, False, 0.05, (4, 2)),
}


def reference_model(transformers, case: str):
    q_lora, yarn, interleave, norm_topk, eps, (n_group, topk_group) = REFERENCE_CASES[case]
    rope = {"rope_type": "default", "rope_theta": 5000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 5000.0, **{k: v for k, v in dataclasses.asdict(YARN).items()}}
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
        rope_parameters=rope, rope_interleave=interleave, rms_norm_eps=eps, norm_topk_prob=norm_topk,
        num_nextn_predict_layers=0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize_(model)
    return model


def convert(folder: Path) -> DeepSeekV3:
    """Our model from an HF folder, through the steps of `convert_checkpoint.py hf-to-dcp` (less the DCP save)."""
    args = ADAPTER.model_args_from_hf_config(hf_folder.read_json(str(folder / "config.json"), "config.json"))
    tensors, _ = hf_folder.read_hf_tensors(str(folder), hf_folder.safetensors_files(str(folder)))
    weights, _ = hf_folder.hf_to_ours(tensors, args, ADAPTER, str(folder))
    model = DeepSeekV3(args).eval()
    model.load_state_dict(weights)  # strict: every name, the expert biases included
    return model


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_converted_reference_models_give_the_reference_logits(transformers, tmp_path, case):
    reference = reference_model(transformers, case)
    reference.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = reference(tokens()).logits
    model = convert(tmp_path)
    assert isinstance(model.args, hf_format.RotateHalfArgs) == (not REFERENCE_CASES[case][2])
    with torch.no_grad():
        ours = model(tokens())
    diff = (ours - expected).abs().max().item()
    print(f"max |logits difference| {case}: {diff:.2e}")
    # The same routing as well: these seeded routers' chosen experts (and groups) lead the next by at
    # least 6e-4 in score, far beyond the two implementations' rounding.
    assert diff <= logits_tolerance(expected)
    routed = [int((layer.moe.tokens_per_expert > 0).sum()) for layer in list(model.layers.values())[1:]]
    assert all(n >= 5 for n in routed), routed  # the router spread its tokens over most experts
    # Greedy generation: ours caches the latents and decodes in the latent space, transformers caches
    # every head's keys and values; the same tokens. No rounding within the two tolerances could
    # change them: transformers' best logit leads the next by more than twice their sum at every step.
    reference.generation_config.eos_token_id = None  # (eos_id None below: neither stops early)
    prompt, new = tokens()[:, :SEQ // 2], SEQ // 2
    with torch.no_grad():
        theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    ours = torch.stack(list(generate(model, prompt.tolist(), new, Sampling(), eos_id=None)), dim=1)
    assert torch.equal(ours, theirs.sequences[:, -new:])
    logits = torch.stack(theirs.logits, dim=1)
    top2 = logits.topk(2).values
    assert (top2[..., 0] - top2[..., 1] > 2 * largest_difference(torch.float32, GENERATION_SUMS, float(logits.abs().max()))).all()
    # The comparison sees the routing bias: without it, other experts are chosen and the logits move.
    with torch.no_grad():
        for layer in list(model.layers.values())[1:]:
            layer.moe.expert_bias.zero_()
        assert (model(tokens()) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_exports_load_in_transformers_with_our_logits(transformers, tmp_path, case):
    """Ours -> HF folder (fresh layout, as dcp-to-hf writes one) -> transformers, silently and with our logits."""
    from tests.unit_tests.test_hf_reference import reference_warnings  # skips its module without transformers

    args = convert_model_args(case)
    model = DeepSeekV3(args).eval()
    randomize_(model)
    hf = hf_folder.to_hf(model.state_dict(), args, ADAPTER)
    hf_folder.write_fresh(str(tmp_path), hf, ADAPTER.hf_config(args, torch_dtype="float32"), 40_000)
    with reference_warnings() as messages:
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert messages == []
    assert type(reference).__name__ == "DeepseekV3ForCausalLM"
    assert reference.config.rope_interleave == REFERENCE_CASES[case][2]
    with torch.no_grad():
        expected = reference(tokens()).logits
        diff = (model(tokens()) - expected).abs().max().item()
    assert diff <= logits_tolerance(expected)


def convert_model_args(case: str) -> DeepSeekV3ModelArgs:
    q_lora, yarn, interleave, norm_topk, eps, (n_group, topk_group) = REFERENCE_CASES[case]
    args = dataclasses.replace(ARGS, q_lora_rank=q_lora or 0, rope_scaling=YARN if yarn else None, norm_eps=eps,
                               norm_topk_prob=norm_topk, n_group=n_group, topk_group=topk_group)
    return args if interleave else _rotate_half(args)


def test_mtp_modules_export_in_deepseeks_layout_and_come_back(transformers, tmp_path):
    """An export with MTP has DeepSeek's layout (layers 3 and 4 for depth 2); transformers loads the
    main model from it (ignoring those layers) with our logits, and an import gives every MTP
    tensor back by name."""
    model = DeepSeekV3(MTP).eval()
    randomize_(model)
    state = model.state_dict()
    hf_folder.write_fresh(str(tmp_path), hf_folder.to_hf(state, MTP, ADAPTER), ADAPTER.hf_config(MTP, "float32"),
                          10**9)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = reference(tokens()).logits
        assert (model(tokens()) - expected).abs().max() <= logits_tolerance(expected)
    back = convert(tmp_path)
    assert back.args == MTP
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    # MTP's loss, which uses every MTP tensor and the shared embedding and head, is the same too.
    back.train(), model.train()
    labels = tokens().roll(-1, dims=1)
    model(tokens(), labels=labels), back(tokens(), labels=labels)
    assert torch.equal(model.take_mtp_loss(), back.take_mtp_loss())


def test_convert_script_round_trip(transformers, tmp_path, capsys):
    """hf-to-dcp and dcp-to-hf on a rotate_half folder: the original files come back byte for byte;
    a fresh layout loads in transformers; a folder whose config.json promises MTP layers it lacks is
    refused in one line."""
    hf_dir, ckpt, exact, fresh = (tmp_path / n for n in ("hf", "ckpt", "exact", "fresh"))
    reference = reference_model(transformers, "lora-yarn-rotate-half-unnormalised-eps")
    reference.save_pretrained(hf_dir)
    assert convert_checkpoint.main(["hf-to-dcp", str(hf_dir), str(ckpt), "--model", "deepseek_v3"]) == 0
    assert convert_checkpoint.main(["dcp-to-hf", str(ckpt), str(exact)]) == 0
    assert sorted(p.name for p in exact.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    for path in hf_dir.iterdir():
        assert (exact / path.name).read_bytes() == path.read_bytes(), path.name
    assert convert_checkpoint.main(["dcp-to-hf", str(ckpt), str(fresh), "--fresh-layout"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(fresh).eval()
    with torch.no_grad():
        assert torch.allclose(again(tokens()).logits, reference(tokens()).logits, atol=1e-5)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    capsys.readouterr()
    assert convert_checkpoint.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "no_mtp"), "--model", "deepseek_v3"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {hf_dir}: config.json promises 1 multi-token prediction layer model.layers.3 "
                   "(num_nextn_predict_layers 1), but the weights hold none (transformers' save_pretrained writes "
                   "num_nextn_predict_layers 1 without them); set num_nextn_predict_layers to 0 in config.json\n"), err


def test_convert_script_dequantizes_fp8_folders(transformers, tmp_path, capsys):
    """An fp8 folder as DeepSeek publishes them (weight_scale_inv beside each matrix, quantization_config)
    converts to the dequantized weights, and exports unquantized: its config.json has no
    quantization_config, and transformers loads the dequantized matrices."""
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference_model(transformers, "lora-yarn-interleaved").save_pretrained(hf_dir)
    tensors, _ = hf_folder.read_hf_tensors(str(hf_dir), ["model.safetensors"])
    g, quantized = torch.Generator().manual_seed(2), {}
    for name, w in tensors.items():
        if "self_attn" in name and w.dim() == 2:
            quantized[name], quantized[name + "_scale_inv"] = _quantize(w, g)
        else:
            quantized[name] = w
    hf_folder.import_safetensors().torch.save_file(quantized, str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = DEEPSEEK_V3["quantization_config"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert convert_checkpoint.main(["hf-to-dcp", str(hf_dir), str(ckpt), "--model", "deepseek_v3"]) == 0
    assert convert_checkpoint.main(["dcp-to-hf", str(ckpt), str(out), "--dtype", "float32"]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    expected = hf_format.dequantize_fp8(quantized[name], quantized[name + "_scale_inv"]).float()
    assert torch.equal(loaded.state_dict()[name], expected)


# ---------------------------------------------------------------------------------------------
# Malformed folders and configs: one line each


def _one_line(call, expected: str) -> None:
    with pytest.raises(CheckpointError) as e:
        call()
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_malformed_tensors_are_refused_in_one_line():
    hf = hf_folder.to_hf(_random_state(ARGS), ARGS, ADAPTER)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    odd = {**hf, name: torch.zeros(5, 64)}  # expert 2 unlike expert 0
    _one_line(lambda: hf_folder.hf_to_ours(odd, ARGS, ADAPTER, "hf"), f"{name} has shape [5, 64], expert 0's")
    fused = {k: v for k, v in hf.items() if ".mlp.experts." not in k or not k.startswith("model.layers.1.")}
    fused |= {"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(7, 64, 64),
              "model.layers.1.mlp.experts.down_proj": torch.zeros(8, 64, 32)}
    _one_line(lambda: hf_folder.hf_to_ours(fused, ARGS, ADAPTER, "hf"),
              "has shape [7, 64, 64], not one matrix for each of config.json's 8 experts")
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _one_line(lambda: hf_format._dequantized({scale: torch.ones(1, 1)}),
              f"{scale} has no model.layers.0.self_attn.o_proj.weight beside it")


def test_malformed_configs_are_refused_in_one_line():
    _one_line(lambda: ADAPTER.model_args_from_hf_config(["not", "an", "object"]), "config.json does not hold a JSON object")
    _one_line(lambda: ADAPTER.model_args_from_hf_config({**CFG, "qk_rope_head_dim": 7}), "qk_rope_head_dim 7 is odd")
    _one_line(lambda: ADAPTER.model_args_from_hf_config({**CFG, "rope_scaling": "yarn"}),
              "rope_scaling 'yarn' is not a JSON object")
    scaling = {**CFG["rope_parameters"], "type": "yarn", "rope_type": "default"}
    _one_line(lambda: ADAPTER.model_args_from_hf_config({**CFG, "rope_parameters": scaling}),
              "rope_parameters type 'yarn' and rope_type 'default' disagree")
    negative = {**CFG["rope_parameters"], "beta_fast": -3}
    _one_line(lambda: ADAPTER.model_args_from_hf_config({**CFG, "rope_parameters": negative, "rope_scaling": None}),
              "beta_fast -3 is not a non-negative number")
    _one_line(lambda: ADAPTER.hf_config(dataclasses.replace(ARGS, norm_type="layernorm")),
              "norm_type 'layernorm' has no DeepseekV3ForCausalLM equivalent")


def test_shapes_that_fit_no_model_are_refused_in_one_line():
    shapes = {k: tuple(v.shape) for k, v in _random_state(ARGS).items()}
    broken = {**shapes, "layers.0.attention.wo.weight": (64, 47)}  # 47 value columns: no head count fits
    _one_line(lambda: ADAPTER.args_with_shapes(ARGS, broken, None, None), "fit no head layout")
    _one_line(lambda: ADAPTER.args_with_shapes(dataclasses.replace(ARGS, num_experts=0), shapes, None, None),
              "the weights hold 8 experts per block, which the routing of")
