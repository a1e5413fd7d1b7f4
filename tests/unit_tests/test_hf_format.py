"""The Llama <-> Hugging Face mapping: names, the q/k RoPE permutation (checked against an HF-style RoPE) and configs
of both transformers layouts, with refusals of what this model cannot compute. Logits against transformers itself:
test_hf_reference.py."""

import dataclasses

import pytest
import torch

from torchtitan.checkpoint.folders import CheckpointError
from torchtitan.models.llama import hf_format, llama2_configs, llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaHFAdapter
from torchtitan.models.llama.model import ModelArgs, RopeScaling, Transformer, apply_rope, ffn_hidden_dim, precompute_rope

SMALL_GQA = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, rope_theta=500000.0)


def _state_dict_names(args: ModelArgs) -> list[str]:
    with torch.device("meta"):
        return list(Transformer(args).state_dict())


@pytest.mark.parametrize("tie", [False, True])
def test_name_mapping_is_a_bijection_on_a_real_state_dict(tie):
    names = _state_dict_names(dataclasses.replace(llama3_configs["debugmodel"], tie_word_embeddings=tie))
    hf_names = [hf_format.to_hf_name(n) for n in names]
    assert len(set(hf_names)) == len(names)
    assert [hf_format.from_hf_name(h) for h in hf_names] == names
    assert "model.layers.7.mlp.gate_proj.weight" in hf_names and "lm_head.weight" in hf_names
    assert sorted(hf_format.param_names(8)) == sorted(names)


@pytest.mark.parametrize("name", ["layers.0.attention.wq.bias", "model.tok_embeddings.weight", "layers.x.ffn_norm.weight"])
def test_unknown_names_are_refused(name):
    with pytest.raises(KeyError):
        hf_format.to_hf_name(name)
    with pytest.raises(KeyError):
        hf_format.from_hf_name(name)
    assert not hf_format.is_llama_name(name)


def test_permute_then_unpermute_is_the_identity():
    w = torch.randn(8 * 16, 64)
    permuted = hf_format.permute_for_hf(w, n_heads=8)
    assert not torch.equal(permuted, w)
    assert torch.equal(hf_format.unpermute_from_hf(permuted, n_heads=8), w)
    assert torch.equal(hf_format.permute_for_hf(hf_format.unpermute_from_hf(w, 8), 8), w)


def _hf_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference RoPE in Hugging Face's layout: dims i and i + head_dim/2 rotate together
    (x * cos + rotate_half(x) * sin); x is (seq, heads, head_dim)."""
    seq, _, head_dim = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :]
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[:, None, :]
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos + rotated * sin


def _scores(q: torch.Tensor, k: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """q_rot . k_rot for every head and pair of positions, each query head reading its kv group."""
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
    return torch.einsum("shd,thd->hst", q, k)


def test_permutation_makes_hf_rope_attention_equal_ours_with_gqa():
    args = dataclasses.replace(SMALL_GQA, max_seq_len=7)
    head_dim, seq = args.dim // args.n_heads, args.max_seq_len
    g = torch.Generator().manual_seed(0)
    x = torch.randn(seq, args.dim, generator=g, dtype=torch.float64)
    wq = torch.randn(args.n_heads * head_dim, args.dim, generator=g, dtype=torch.float64)
    wk = torch.randn(args.n_kv_heads * head_dim, args.dim, generator=g, dtype=torch.float64)

    rope = precompute_rope(args).double()
    ours_q = apply_rope((x @ wq.T).view(1, seq, -1, head_dim), rope)[0]
    ours_k = apply_rope((x @ wk.T).view(1, seq, -1, head_dim), rope)[0]
    ours = _scores(ours_q, ours_k, args.n_heads, args.n_kv_heads)

    hf_wq = hf_format.to_hf_tensor("layers.0.attention.wq.weight", wq, args)
    hf_wk = hf_format.to_hf_tensor("layers.0.attention.wk.weight", wk, args)
    hf_q = _hf_rope((x @ hf_wq.T).view(seq, -1, head_dim), args.rope_theta)
    hf_k = _hf_rope((x @ hf_wk.T).view(seq, -1, head_dim), args.rope_theta)
    # apply_rope computes in float32, so agreement is to float32 precision.
    torch.testing.assert_close(_scores(hf_q, hf_k, args.n_heads, args.n_kv_heads), ours, rtol=1e-4, atol=1e-3)

    unpermuted = _scores(_hf_rope((x @ wq.T).view(seq, -1, head_dim), args.rope_theta),
                         _hf_rope((x @ wk.T).view(seq, -1, head_dim), args.rope_theta), args.n_heads, args.n_kv_heads)
    assert not torch.allclose(unpermuted, ours, rtol=1e-2, atol=1e-1)  # without the permutation they differ


def _hf_forward(sd: dict[str, torch.Tensor], cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a Hugging Face style Llama (names, rotate_half RoPE, GQA) written from its
    definition, for one sequence of token ids."""
    dim, n_heads, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, seq = dim // n_heads, len(tokens)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * w

    h = sd["model.embed_tokens.weight"][tokens]
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = _hf_rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(seq, n_heads, head_dim), cfg["rope_theta"])
        k = _hf_rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(seq, n_kv, head_dim), cfg["rope_theta"])
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(seq, n_kv, head_dim).repeat_interleave(n_heads // n_kv, dim=1)
        weights = torch.softmax(_scores(q.float(), k.float(), n_heads, n_kv) / head_dim**0.5 + causal, dim=-1)
        attn = torch.einsum("hst,thd->shd", weights, v).reshape(seq, dim)
        h = h + attn @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_converted_weights_give_the_same_logits_in_an_hf_style_model():
    """Whole-model check of names and layouts (gate/up/down, the two norms, q/k permutation)."""
    torch.manual_seed(0)
    args = dataclasses.replace(SMALL_GQA, max_seq_len=12)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so that swapped norms would show
                param.uniform_(0.5, 1.5)
    tokens = torch.randint(0, args.vocab_size, (args.max_seq_len,))
    with torch.no_grad():
        ours = model(tokens[None])[0]
        hf_sd = {hf_format.to_hf_name(k): hf_format.to_hf_tensor(k, v, args) for k, v in model.state_dict().items()}
        theirs = _hf_forward(hf_sd, hf_format.hf_config(args), tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_tensors_other_than_q_and_k_keep_their_layout():
    w = torch.randn(64, 64)
    for name in ("layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "tok_embeddings.weight"):
        assert hf_format.to_hf_tensor(name, w, SMALL_GQA) is w
        assert hf_format.from_hf_tensor(name, w, SMALL_GQA) is w
    wk = torch.randn(32, 64)
    assert torch.equal(hf_format.from_hf_tensor("layers.1.attention.wk.weight",
                                                hf_format.to_hf_tensor("layers.1.attention.wk.weight", wk, SMALL_GQA),
                                                SMALL_GQA), wk)


def _shapes(args: ModelArgs) -> tuple:
    """Everything that decides the computation (max_seq_len aside: the length of the RoPE table)."""
    return (args.dim, args.n_layers, args.n_heads, args.n_kv_heads or args.n_heads, args.vocab_size + args.vocab_padding,
            ffn_hidden_dim(args), args.norm_eps, args.rope_theta, args.rope_scaling, args.tie_word_embeddings)


ALL_FLAVORS = {f"llama2 {k}": v for k, v in llama2_configs.items()} | {f"llama3 {k}": v for k, v in llama3_configs.items()}


@pytest.mark.parametrize("flavor", list(ALL_FLAVORS))
def test_config_round_trip_keeps_every_shape(flavor):
    args = ALL_FLAVORS[flavor]
    back = hf_format.model_args_from_hf_config(hf_format.hf_config(args))
    assert _shapes(back) == _shapes(args) and back.max_seq_len >= args.max_seq_len
    # The published flavors' feed-forward settings are recovered, not just their result.
    assert (back.multiple_of, back.ffn_dim_multiplier) == (args.multiple_of, args.ffn_dim_multiplier)


def test_config_fields_of_llama3_8b():
    """RoPE in both layouts; a scaled model advertises more positions than the original context,
    as transformers requires (max_seq_len, the training length, is 2048 here)."""
    config = hf_format.hf_config(llama3_configs["8B"], torch_dtype="bfloat16", bos_token_id=128000)
    assert config["intermediate_size"] == 14336 and config["num_key_value_heads"] == 8 and config["head_dim"] == 128
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["rope_scaling"] == {"rope_type": "llama3", **scaling} and config["rope_theta"] == 500000.0
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
    assert config["max_position_embeddings"] == 65536
    assert config["hidden_act"] == "silu" and config["tie_word_embeddings"] is False and config["bos_token_id"] == 128000
    llama2 = hf_format.hf_config(llama2_configs["7B"])
    assert llama2["rope_scaling"] is None and llama2["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert llama2["max_position_embeddings"] == 2048
    factor_one = dataclasses.replace(llama3_configs["8B"], rope_scaling=RopeScaling(factor=1.0), max_seq_len=8192)
    assert hf_format.hf_config(factor_one)["max_position_embeddings"] == 8193


def test_transformers_5_config_of_llama_3_2_1b():
    """A config.json as today's transformers saves Llama 3.2 1B: RoPE only under `rope_parameters`
    (read as theta 10,000 without scaling before, which moved the logits by 4.2)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
           "dtype": "bfloat16", "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
           "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
           "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
           "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"},
           "tie_word_embeddings": True, "transformers_version": "5.0.0", "use_cache": True, "vocab_size": 128256}
    args = hf_format.model_args_from_hf_config(cfg)
    assert _shapes(args) == _shapes(llama3_configs["1B"]) and args.max_seq_len == 131072
    assert args.rope_scaling == RopeScaling(factor=32.0) and args.rope_theta == 500000.0 and args.tie_word_embeddings


def test_absent_fields_get_the_defaults_of_transformers():
    """What LlamaConfig assumes for a field a config.json leaves out (or sets to null)."""
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
           "num_key_value_heads": None, "head_dim": None}
    args = hf_format.model_args_from_hf_config(cfg)
    assert (args.rope_theta, args.rope_scaling, args.norm_eps, args.max_seq_len) == (10000.0, None, 1e-6, 2048)
    assert args.n_kv_heads is None and args.tie_word_embeddings is False
    # Theta from the top level fills a rope_parameters dict without one, as transformers 5 does; a
    # llama3 dict without the original context uses max_position_embeddings.
    llama3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0}
    args = hf_format.model_args_from_hf_config({**cfg, "rope_theta": 20000.0, "rope_parameters": llama3, "rope_scaling": llama3,
                                                "max_position_embeddings": 512, "hidden_act": "swish", "attention_dropout": 0})
    assert args.rope_theta == 20000.0
    assert args.rope_scaling == RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                            original_max_position_embeddings=512)


def test_published_hf_config_of_llama_3_1_8b():
    """A config.json as Hugging Face publishes it (older `type` key and extra fields included)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
           "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
           "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
           "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192, "type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
    args = hf_format.model_args_from_hf_config(cfg)
    assert _shapes(args)[:6] == _shapes(llama3_configs["8B"])[:6]
    assert args.rope_scaling == RopeScaling() and args.max_seq_len == 131072


@pytest.mark.parametrize("dim,hidden", [(64, 128), (64, 172), (64, 1000), (256, 768), (4096, 11008), (100, 7)])
def test_any_intermediate_size_is_reproduced(dim, hidden):
    args = hf_format.with_ffn_hidden_dim(ModelArgs(dim=dim, n_heads=4), hidden)
    assert ffn_hidden_dim(args) == hidden


LLAMA3_FIELDS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DROP = object()  # a change that removes the field
NEW_LAYOUT = {"rope_scaling": DROP, "rope_theta": DROP}  # keeps only the current layout of an exported config


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling rope_type 'yarn' is not supported"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters rope_type 'dynamic'"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters rope_type 'linear'"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "llama3", **LLAMA3_FIELDS, "beta_fast": 32}},
     "rope_parameters key 'beta_fast' is not understood for rope_type 'llama3'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "llama3", **LLAMA3_FIELDS, "mscale": 1.0}}, "rope_scaling key 'mscale'"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters key 'factor' is not understood for rope_type 'default'"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope_parameters lacks low_freq_factor"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "llama3", **LLAMA3_FIELDS, "factor": "8"}}, "rope_parameters factor '8'"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "rope_parameters partial_rotary_factor 0.5"),
    ({**NEW_LAYOUT, "rope_parameters": ["default"]}, "rope_parameters ['default'] is not a JSON object"),
    ({"rope_scaling": {"type": "llama3", "rope_type": "linear"}}, "rope_scaling type 'llama3' and rope_type 'linear' disagree"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3_FIELDS}},
     "rope_parameters (theta 500000, no scaling) and rope_theta/rope_scaling (theta 500000, llama3 factor 8"),
    ({"rope_theta": 10000.0}, "rope_parameters rope_theta 500000.0 and the top-level rope_theta 10000.0 disagree"),
    ({**NEW_LAYOUT, "rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_parameters rope_theta -1"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"attention_bias": True}, "attention_bias True is not supported"),
    ({"mlp_bias": True}, "mlp_bias True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ({"head_dim": 32}, "head_dim 32 is not hidden_size / num_attention_heads (16)"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not llama"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
    ({"hidden_size": "64"}, "hidden_size '64' is not a positive integer"),
    ({"rms_norm_eps": 0}, "rms_norm_eps 0 is not a positive number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings 'yes'"),
    ({"hidden_size": DROP, "vocab_size": DROP}, "config.json lacks hidden_size, vocab_size"),
])
def test_configs_this_model_cannot_reproduce_are_refused(change, message):
    """One line that names the field, never a default in its place."""
    cfg = {**hf_format.hf_config(dataclasses.replace(SMALL_GQA, rope_theta=500000.0)), **change}
    cfg = {k: v for k, v in cfg.items() if v is not DROP}
    with pytest.raises(CheckpointError) as refusal:
        hf_format.model_args_from_hf_config(cfg)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


def test_a_config_that_is_no_json_object_is_refused():
    with pytest.raises(CheckpointError, match="^config.json does not hold a JSON object$"):
        hf_format.model_args_from_hf_config([hf_format.hf_config(SMALL_GQA)])


def _shapes_of(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}


@pytest.mark.parametrize("base,n_heads,n_kv_heads,message", [
    (llama3_configs["debugmodel"], None, None,
     "the weights have dim 64, not the 256 of the flavor they claim, so their head count is unknown; pass --n-heads "
     "(and --n-kv-heads)"),
    (None, 3, None, "dim 64 is not divisible by 3 heads; pass --n-heads"),
    (None, 4, 4, "--n-kv-heads 4 does not fit the key projection's 2 heads of 16 dims"),
])
def test_shapes_that_leave_the_head_count_unknown_are_refused(base, n_heads, n_kv_heads, message):
    """dcp-to-hf of a checkpoint without its config.json: the head count comes from the flavor or the
    flags, and must fit the shapes (SMALL_GQA: dim 64, 4 heads, 2 key/value heads)."""
    adapter = LlamaHFAdapter()
    with pytest.raises(CheckpointError) as refusal:
        adapter.args_with_shapes(base, _shapes_of(SMALL_GQA), n_heads, n_kv_heads)
    assert str(refusal.value) == message
    args = adapter.args_with_shapes(None, _shapes_of(SMALL_GQA), 4, 2)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.n_layers) == (64, 4, 2, 2)


def test_both_layouts_of_an_export_are_read_alike():
    """Each layout alone gives the same model as the two together (what transformers 4 and 5 each read)."""
    args = llama3_configs["1B"]
    both = hf_format.hf_config(args)
    new = {k: v for k, v in both.items() if k not in ("rope_theta", "rope_scaling")}
    old = {k: v for k, v in both.items() if k != "rope_parameters"}
    read = [hf_format.model_args_from_hf_config(cfg) for cfg in (both, new, old)]
    assert read[0] == read[1] == read[2] and _shapes(read[0]) == _shapes(args)
