"""Qwen3 and Qwen3-MoE <-> Hugging Face: names, tensor layouts, config.json, and the reference.

Tiny random `Qwen3ForCausalLM`s and `Qwen3MoeForCausalLM`s are built in this process (no hub) with
head_dim 24, not hidden / heads (16), so an implicit head_dim shows; saved with `save_pretrained`
they must convert to our `Qwen3` with the reference's logits, and come back as the same tensors,
byte for byte, under the same names. The other way, our exports must load in transformers without
a warning and give our logits. Every config.json field this model cannot compute is refused in one
line naming it.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtitan.checkpoint import hf_folder
from torchtitan.errors import CheckpointError
from torchtitan.models.hf_adapter import rope_rows_from_hf, rope_rows_to_hf
from torchtitan.models.qwen3 import hf_format, qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3HFAdapter
from torchtitan.models.qwen3.model import Qwen3, Qwen3ModelArgs

ADAPTER = Qwen3HFAdapter()
SEQ, VOCAB, THETA = 12, 101, 1_000_000.0  # theta not transformers' default of 10,000, so a misread shows
# hidden 64 with 4 heads of 24 dims (not 64 / 4), grouped-query attention, 8 experts of which 2 per token.
SHAPES = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=VOCAB, rope_theta=THETA,
              max_seq_len=64)
DENSE = Qwen3ModelArgs(**SHAPES, hidden_dim=96)
MOE = Qwen3ModelArgs(**SHAPES, hidden_dim=96, num_experts=8, top_k=2, moe_hidden_dim=32)


def _names(args: Qwen3ModelArgs) -> list[str]:
    with torch.device("meta"):
        return list(Qwen3(args).state_dict())


def _random_state(args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3(args).state_dict().items()}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    if args.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


# ---------------------------------------------------------------------------------------------
# Names and tensors


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_every_name_maps_there_and_back(moe, tie):
    args = dataclasses.replace(MOE if moe else DENSE, tie_word_embeddings=tie)
    names = _names(args)
    assert sorted(ADAPTER.whole_model_names(names)) == sorted(names) == sorted(hf_format.param_names(3, moe))
    for name in names:
        hf = ADAPTER.to_hf_name(name)
        if name.endswith("expert_bias"):
            assert hf is None  # no HF counterpart
            continue
        if ".moe.experts." in name:  # one HF tensor per expert
            assert hf.count("*") == 1
            assert all(ADAPTER.from_hf_names(hf.replace("*", str(j))) == (name,) for j in (0, 7))
        else:
            assert ADAPTER.from_hf_names(hf) == (name,)
    for bad in ("layers.0.moe.experts.w4", "layers.0.attention.wq.bias", "vision.proj.weight", "layers.x.ffn_norm.weight"):
        with pytest.raises(KeyError):
            ADAPTER.to_hf_name(bad)
    for bad in ("model.layers.0.mlp.experts.0.gate_proj.bias", "model.layers.0.mlp.experts.gate_proj",
                "model.layers.0.self_attn.q_proj.bias", "lm_head.bias"):
        with pytest.raises(KeyError):
            ADAPTER.from_hf_names(bad)


def test_hf_names_are_those_of_published_checkpoints():
    hf = hf_folder.to_hf(_random_state(MOE), MOE, ADAPTER)
    block = sorted(k.removeprefix("model.layers.1.") for k in hf if k.startswith("model.layers.1."))
    assert block == sorted(["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                            *(f"mlp.experts.{j}.{p}.weight" for j in range(8) for p in ("gate_proj", "up_proj", "down_proj")),
                            *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))])
    # Experts in numeric order within a block, so a shard boundary never splits one expert from the next.
    twelve = dataclasses.replace(MOE, num_experts=12)
    experts = [k for k in hf_folder.to_hf(_random_state(twelve), twelve, ADAPTER) if ".mlp.experts." in k]
    assert experts[:6] == [f"model.layers.0.mlp.experts.{j}.{p}_proj.weight" for j in (0, 1) for p in ("down", "gate", "up")]
    assert [int(k.split(".")[5]) for k in experts[:36]] == [j for j in range(12) for _ in range(3)]
    assert hf["model.layers.2.mlp.experts.5.up_proj.weight"].shape == (32, 64)
    assert hf["model.layers.2.mlp.experts.5.down_proj.weight"].shape == (64, 32)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tensors_round_trip(moe, tie):
    """Ours -> HF -> ours is the identity, the expert bias aside: HF has none, an import starts it at zero."""
    args = dataclasses.replace(MOE if moe else DENSE, tie_word_embeddings=tie)
    state = _random_state(args)
    hf = hf_folder.to_hf(state, args, ADAPTER)
    if tie:
        hf.pop("lm_head.weight")
    back, _ = hf_folder.hf_to_ours(hf, args, ADAPTER, "hf")
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        expected = torch.zeros_like(tensor) if name.endswith("expert_bias") else tensor
        assert torch.equal(back[name], expected), name
    if tie:
        assert back["output.weight"] is back["tok_embeddings.weight"]


def test_q_k_rows_and_norms_are_permuted_within_each_head():
    state = _random_state(MOE)
    hf = hf_folder.to_hf(state, MOE, ADAPTER)
    assert torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], rope_rows_to_hf(state["layers.0.attention.wq.weight"], 4))
    assert torch.equal(hf["model.layers.0.self_attn.k_proj.weight"], rope_rows_to_hf(state["layers.0.attention.wk.weight"], 2))
    q_norm = state["layers.0.attention.q_norm.weight"]
    # Our feature 2i (the first of RoPE pair i) is HF's feature i, our 2i+1 HF's i + head_dim/2.
    assert torch.equal(hf["model.layers.0.self_attn.q_norm.weight"], torch.cat([q_norm[0::2], q_norm[1::2]]))
    assert torch.equal(rope_rows_from_hf(rope_rows_to_hf(q_norm, 1), 1), q_norm)
    for name in ("self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight"):
        assert not torch.equal(hf[f"model.layers.0.{name}"], rope_rows_to_hf(hf[f"model.layers.0.{name}"], 2))


def test_missing_extra_and_mixed_experts_are_refused_in_one_line():
    hf = hf_folder.to_hf(_random_state(MOE), MOE, ADAPTER)
    cases = {
        "missing": ({k: v for k, v in hf.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
                    "hf: model.layers.1.mlp.experts.3.up_proj.weight is missing (config.json has 8 experts)"),
        "beyond": ({**hf, "model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)},
                   "hf: model.layers.0.mlp.experts.8.gate_proj.weight is beyond config.json's 8 experts"),
        "shape": ({**hf, "model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(64, 30)},
                  "model.layers.0.mlp.experts.2.down_proj.weight has shape [64, 30], expert 0's [64, 32]"),
        "mixed": ({**hf, "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 64, 32)},
                  "both hold layers.0.moe.experts.w2; keep one layout of the experts"),
        "fused count": ({**{k: v for k, v in hf.items() if ".mlp.experts." not in k or not k.startswith("model.layers.0.")},
                         "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(6, 64, 64),
                         "model.layers.0.mlp.experts.down_proj": torch.zeros(6, 64, 32)},
                        "has shape [6, 64, 64], not one matrix for each of config.json's 8 experts"),
        "unknown": ({**hf, "model.layers.0.mlp.shared_expert.gate_proj.weight": torch.zeros(1)},
                    "hf holds tensors that are not Qwen3MoeForCausalLM parameters: model.layers.0.mlp.shared_expert"),
    }
    for case, (tensors, expected) in cases.items():
        with pytest.raises(CheckpointError) as e:
            hf_folder.hf_to_ours(tensors, MOE, ADAPTER, "hf")
        assert expected in str(e.value) and "\n" not in str(e.value), case


# ---------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("flavor", list(qwen3_configs))
def test_config_round_trips_for_every_flavor(flavor):
    args = qwen3_configs[flavor]
    config = hf_format.hf_config(args)
    assert config["architectures"] == [ADAPTER.hf_architecture(args)]
    assert ADAPTER.model_args_from_hf_config(json.loads(json.dumps(config))) == args


# As published on the hub (transformers 4.51 layout: top-level rope_theta, rope_scaling null).
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
              "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
              "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                 "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
                 "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("config,flavor", [(QWEN3_0_6B, "0.6B"), (QWEN3_30B_A3B, "30B-A3B")])
def test_published_configs_read_as_their_flavors(config, flavor):
    args = ADAPTER.model_args_from_hf_config(config)
    # intermediate_size sizes only the dense blocks a Qwen3-MoE has none of; it is kept for the way back.
    assert args == dataclasses.replace(qwen3_configs[flavor], max_seq_len=40960, hidden_dim=config["intermediate_size"])
    # transformers 5's save_pretrained spells the expert count num_local_experts, and keeps RoPE in rope_parameters.
    if args.is_moe:
        current = {k: v for k, v in config.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
        current.update(num_local_experts=128, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        assert ADAPTER.model_args_from_hf_config(current) == args


def test_absent_fields_get_transformers_defaults():
    dense = ADAPTER.model_args_from_hf_config({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 64, "intermediate_size": 96, "vocab_size": 10})
    assert (dense.head_dim, dense.n_kv_heads, dense.rope_theta, dense.norm_eps, dense.max_seq_len) == (128, 32, 10000.0,
                                                                                                       1e-6, 32768)
    assert not dense.is_moe and not dense.tie_word_embeddings
    moe = ADAPTER.model_args_from_hf_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
                                             "num_attention_heads": 8, "moe_intermediate_size": 16, "vocab_size": 10})
    # Qwen3MoeConfig: head_dim hidden / heads, 4 key/value heads, 128 experts, 8 per token, not renormalised.
    assert (moe.head_dim, moe.n_kv_heads, moe.num_experts, moe.top_k, moe.norm_topk_prob) == (8, 4, 128, 8, False)


MOE_CFG = hf_format.hf_config(MOE)
DENSE_CFG = hf_format.hf_config(DENSE)
# (config, the field's new value or None to delete it, what the one-line refusal says)
REFUSALS = {
    "attention_bias": (DENSE_CFG, {"attention_bias": True}, "attention_bias True is not supported"),
    "hidden_act": (DENSE_CFG, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    "attention_dropout": (MOE_CFG, {"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    "use_sliding_window": (DENSE_CFG, {"use_sliding_window": True, "sliding_window": 8},
                           "use_sliding_window True is not supported"),
    "layer_types": (DENSE_CFG, {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
                    "layer_types ['full_attention', 'sliding_attention', 'full_attention'] is not supported"),
    "mlp_only_layers": (MOE_CFG, {"mlp_only_layers": [1]}, "mlp_only_layers [1] is not supported"),
    "decoder_sparse_step": (MOE_CFG, {"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    "rope_parameters yarn": (MOE_CFG, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": THETA,
                                                           "original_max_position_embeddings": 32768}},
                             "rope_parameters rope_type 'yarn' is not supported"),
    "rope_scaling yarn": (DENSE_CFG, {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
                          "rope_scaling rope_type 'yarn' is not supported"),
    "rope key": (DENSE_CFG, {"rope_parameters": {"rope_type": "default", "rope_theta": THETA, "factor": 2.0}},
                 "rope_parameters key 'factor' is not understood"),
    "partial_rotary_factor": (DENSE_CFG, {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    "rope_parameters partial_rotary_factor": (DENSE_CFG, {"rope_parameters": {"rope_theta": THETA, "partial_rotary_factor": 0.5}},
                                              "rope_parameters partial_rotary_factor 0.5 is not supported (this Qwen3 "
                                              "rotates whole heads)"),
    "rope_parameters list": (DENSE_CFG, {"rope_parameters": ["default"]}, "rope_parameters ['default'] is not a JSON object"),
    "rope_scaling type": (DENSE_CFG, {"rope_scaling": {"type": "default", "rope_type": "yarn"}},
                          "rope_scaling type 'default' and rope_type 'yarn' disagree"),
    "tie_word_embeddings": (DENSE_CFG, {"tie_word_embeddings": "yes"}, "tie_word_embeddings 'yes' is not true or false"),
    "rope_theta": (DENSE_CFG, {"rope_theta": 10000.0}, "rope_theta 10000 and rope_parameters rope_theta 1e+06 disagree"),
    "quantization_config": (DENSE_CFG, {"quantization_config": {"quant_method": "fp8"}},
                            "quantization_config is not supported"),
    "model_type": (DENSE_CFG, {"model_type": "llama"}, "model_type 'llama' is not qwen3 or qwen3_moe"),
    "num_local_experts": (MOE_CFG, {"num_local_experts": 16}, "num_experts 8 and num_local_experts 16 disagree"),
    "num_experts_per_tok": (MOE_CFG, {"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
    "norm_topk_prob": (MOE_CFG, {"norm_topk_prob": "yes"}, "norm_topk_prob 'yes' is not true or false"),
    "moe_intermediate_size": (MOE_CFG, {"moe_intermediate_size": None}, "config.json lacks moe_intermediate_size"),
    "num_key_value_heads": (DENSE_CFG, {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of "
                                                                  "num_key_value_heads 3"),
    "head_dim": (DENSE_CFG, {"head_dim": 0}, "head_dim 0 is not a positive integer"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_fields_this_model_cannot_compute_are_refused_in_one_line(case):
    base, change, expected = REFUSALS[case]
    config = {**base, **change}
    for key in [k for k, v in change.items() if v is None and k != "rope_parameters"]:
        del config[key]
    with pytest.raises(CheckpointError) as e:
        ADAPTER.model_args_from_hf_config(config)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_config_that_is_no_json_object_is_refused():
    with pytest.raises(CheckpointError, match="^config.json does not hold a JSON object$"):
        ADAPTER.model_args_from_hf_config([DENSE_CFG])


def test_fields_that_do_not_change_the_computation_are_accepted():
    config = {**MOE_CFG, "norm_topk_prob": False, "output_router_logits": True, "router_aux_loss_coef": 0.01,
              "sliding_window": 4096, "max_window_layers": 1, "bos_token_id": 1, "use_cache": False, "dtype": "float32"}
    assert ADAPTER.model_args_from_hf_config(config) == dataclasses.replace(MOE, norm_topk_prob=False)
    layer_types = {**DENSE_CFG, "layer_types": ["full_attention"] * 3}
    assert ADAPTER.model_args_from_hf_config(layer_types) == DENSE


def test_args_from_shapes_alone():
    for args in (DENSE, MOE, dataclasses.replace(MOE, tie_word_embeddings=True, n_kv_heads=4)):
        shapes = {k: tuple(v.shape) for k, v in _random_state(args).items()}
        assert ADAPTER.args_with_shapes(args, shapes, None, None) == args
        assert ADAPTER.args_with_shapes(args, shapes, 4, args.n_kv_heads) == args
        # head counts show in the shapes (head_dim is the q norm's length), other flavors' sizes are replaced
        other = qwen3_configs["debugmodel_moe" if args.is_moe else "debugmodel"]
        got = ADAPTER.args_with_shapes(other, shapes, None, None)
        assert (got.dim, got.n_heads, got.n_kv_heads, got.head_dim, got.n_layers, got.vocab_size) == (
            64, 4, args.n_kv_heads, 24, 3, VOCAB)
    shapes = {k: tuple(v.shape) for k, v in _random_state(MOE).items()}
    with pytest.raises(CheckpointError, match=r"^--n-heads 8 does not fit layers.0.attention.wq.weight's 4 heads of 24 dims$"):
        ADAPTER.args_with_shapes(MOE, shapes, 8, None)
    with pytest.raises(CheckpointError, match="the weights hold 8 experts per block, but the flavor they claim has none"):
        ADAPTER.args_with_shapes(DENSE, shapes, None, None)
    with pytest.raises(CheckpointError, match="fewer than the 16 per token of the flavor they claim"):
        ADAPTER.args_with_shapes(dataclasses.replace(MOE, num_experts=32, top_k=16), shapes, None, None)


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
    """Weights large enough that attention is far from uniform (so RoPE matters), norms not all ones
    (so an unpermuted q/k norm would show) and router scores spread over several units (so experts
    are chosen by the tokens, not by ties); a tied matrix is one parameter and drawn once."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith("mlp.gate.weight") or name.endswith("router.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


def reference_model(transformers, moe: bool, tie: bool, norm_topk_prob: bool = True):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": THETA})
    if moe:
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                             norm_topk_prob=norm_topk_prob)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model = model.eval()
    randomize_(model)
    return model


def convert(folder: Path) -> Qwen3:
    """Our model from an HF folder, through the steps of `convert_checkpoint.py hf-to-dcp` (less the DCP save)."""
    args = ADAPTER.model_args_from_hf_config(hf_folder.read_json(str(folder / "config.json"), "config.json"))
    tensors, _ = hf_folder.read_hf_tensors(str(folder), hf_folder.safetensors_files(str(folder)))
    weights, _ = hf_folder.hf_to_ours(tensors, args, ADAPTER, str(folder))
    model = Qwen3(args).eval()
    model.load_state_dict(weights)  # strict: every name, the expert bias included
    return model


def routed_experts(model: Qwen3) -> list[int]:
    """How many experts each MoE block sent tokens to since the model was built."""
    return [int((layer.moe.tokens_per_expert > 0).sum()) for layer in model.layers.values()]


REFERENCE_CASES = [("dense", False, True), ("dense", True, True), ("moe", False, True), ("moe", True, True),
                   ("moe", False, False)]


@pytest.mark.parametrize("kind,tie,norm_topk", REFERENCE_CASES,
                         ids=[f"{k}-{'tied' if t else 'untied'}{'' if n else '-unnormalised'}" for k, t, n in REFERENCE_CASES])
def test_converted_reference_models_give_the_reference_logits(transformers, tmp_path, kind, tie, norm_topk):
    reference = reference_model(transformers, kind == "moe", tie, norm_topk)
    reference.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = reference(tokens()).logits
    model = convert(tmp_path)
    assert model.args.head_dim == 24 and model.args.rope_theta == THETA and model.args.norm_topk_prob == norm_topk
    with torch.no_grad():
        ours = model(tokens())
    diff = (ours - expected).abs().max().item()
    print(f"max |logits difference| {kind}, tied {tie}, norm_topk_prob {norm_topk}: {diff:.2e}")
    assert diff <= 1e-4
    if kind == "moe":  # the router spread its tokens: most experts of every block got some
        assert all(n >= 6 for n in routed_experts(model)), routed_experts(model)


def test_the_comparison_sees_the_q_k_norm_permutation(transformers, tmp_path):
    """Left in HF's order, the q/k norm weights give far other logits: the test above would see it."""
    reference = reference_model(transformers, moe=True, tie=False)
    reference.save_pretrained(tmp_path)
    model = convert(tmp_path)
    with torch.no_grad():
        expected = reference(tokens()).logits
        for layer in model.layers.values():
            for norm in (layer.attention.q_norm, layer.attention.k_norm):
                norm.weight.copy_(rope_rows_to_hf(norm.weight, 1))
        assert (model(tokens()) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_pretrained_folders_round_trip_byte_for_byte(transformers, tmp_path, moe, tie):
    """HF folder -> ours -> HF: the same names and tensor bytes; with the sidecar hf-to-dcp keeps,
    the same files."""
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference_model(transformers, moe, tie).save_pretrained(hf_dir)
    args = ADAPTER.model_args_from_hf_config(hf_folder.read_json(str(hf_dir / "config.json"), "config.json"))
    files = hf_folder.safetensors_files(str(hf_dir))
    original, headers = hf_folder.read_hf_tensors(str(hf_dir), files)
    ours, buffers = hf_folder.hf_to_ours(original, args, ADAPTER, str(hf_dir))
    if moe:
        assert ours["layers.0.moe.experts.w1"].shape == (8, 32, 64)
        assert torch.equal(ours["layers.2.moe.expert_bias"], torch.zeros(8))

    back = hf_folder.to_hf(ours, args, ADAPTER)
    if tie:
        back.pop("lm_head.weight")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and bytes(hf_folder._raw_bytes(back[name])) == bytes(
            hf_folder._raw_bytes(tensor)), name

    ckpt.mkdir()
    hf_folder.sidecar_writer(str(hf_dir), files, headers, buffers)(str(ckpt))
    sidecar = str(ckpt / hf_folder.SIDECAR)
    layout = hf_folder.read_layout(sidecar)
    plan = hf_folder.try_exact_plan(back, sidecar, layout, tie)
    assert isinstance(plan, dict), plan
    out.mkdir()
    hf_folder.write_exact(str(out), sidecar, layout, plan)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    for path in hf_dir.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_transformers_fused_experts_read_as_the_published_layout(transformers, tmp_path, capsys):
    """`save_pretrained(save_original_format=False)` writes transformers 5's own fused experts
    (`gate_up_proj`, `down_proj`): they read as the same model, which exports the published layout,
    and the converter says that is why it does not give the original files back."""
    reference = reference_model(transformers, moe=True, tie=False)
    reference.save_pretrained(tmp_path / "published")
    reference.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused_names = hf_folder.read_hf_tensors(str(tmp_path / "fused"), ["model.safetensors"])[0]
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused_names
    published, fused = convert(tmp_path / "published"), convert(tmp_path / "fused")
    for (name, a), (_, b) in zip(published.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(a, b), name
    exported = hf_folder.to_hf(fused.state_dict(), fused.args, ADAPTER)
    assert sorted(exported) == sorted(hf_folder.read_hf_tensors(str(tmp_path / "published"), ["model.safetensors"])[0])
    from scripts import convert_checkpoint

    assert convert_checkpoint.main(["hf-to-dcp", str(tmp_path / "fused"), str(tmp_path / "dcp"), "--model", "qwen3"]) == 0
    capsys.readouterr()
    assert convert_checkpoint.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert capsys.readouterr().err == (
        "warning: writing a fresh layout, not the original files: they hold the experts fused (model.layers.0.mlp."
        "experts.down_proj: transformers' own layout), and this export writes them one tensor per expert (model.layers."
        "0.mlp.experts.0.down_proj.weight, ...), as published models are\n")


EXPORTS = {"dense-untied": (DENSE, False), "dense-tied": (DENSE, True), "moe-untied": (MOE, False),
           "moe-tied-unnormalised": (dataclasses.replace(MOE, norm_topk_prob=False), True)}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_exports_load_in_transformers_silently_with_our_logits(transformers, tmp_path, case):
    from tests.unit_tests.test_hf_reference import reference_warnings  # skips its module without transformers

    base, tie = EXPORTS[case]
    args = dataclasses.replace(base, tie_word_embeddings=tie, max_seq_len=SEQ)
    model = Qwen3(args).eval()
    randomize_(model)
    hf = hf_folder.to_hf(model.state_dict(), args, ADAPTER)
    if tie:  # as dcp-to-hf does: HF stores a tied output projection only as the embedding
        hf.pop("lm_head.weight")
    # Shards of a few experts each: views of one stacked tensor are written apart.
    hf_folder.write_fresh(str(tmp_path), hf, ADAPTER.hf_config(args, torch_dtype="float32"), 40_000)
    with reference_warnings() as messages:
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert messages == []
    assert type(reference).__name__ == ADAPTER.hf_architecture(args)
    assert reference.config.tie_word_embeddings == tie and reference.config.head_dim == 24
    with torch.no_grad():
        ours, theirs = model(tokens()), reference(tokens()).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logits difference| export {case}: {diff:.2e}")
    assert diff <= 1e-4
    if args.is_moe:
        assert all(n >= 6 for n in routed_experts(model)), routed_experts(model)
