"""Tests for the DeepSeek-V3 model: published sizes, structure, multi-head latent attention against
an independent reference, multi-token prediction's loss and gradients, and the family's refusals.
Logits against `transformers` are test_deepseek_v3_hf.py's."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TINY_RUN
from tests.tolerances import reordered_sums, transformer_sums
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.errors import ConfigError
from torchtitan.models.deepseek_v3 import DeepSeekV3, DeepSeekV3ModelArgs, deepseek_v3_configs
from torchtitan.models.deepseek_v3.model import YarnScaling, labels_ahead, mtp_params, param_counts, rope_table

# Every part at toy width: compressed queries, 2 dense + 2 MoE blocks, 8 experts in 4 groups, MTP 2.
TINY = dict(dim=32, n_layers=4, n_dense_layers=2, n_heads=4, hidden_dim=48, vocab_size=64, max_seq_len=16,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_experts=8,
            n_shared_experts=1, top_k=2, moe_hidden_dim=16, score_func="sigmoid", n_group=4, topk_group=2,
            route_scale=2.5, mtp_depth=2)


def build(seed=0, **overrides):
    with torch.device("meta"):
        model = DeepSeekV3(DeepSeekV3ModelArgs(**{**TINY, **overrides}))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def n_params(model, skip=()):
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(skip))


# ---------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize("flavor", list(deepseek_v3_configs))
def test_shape_only_counts_equal_the_built_model(flavor):
    args = deepseek_v3_configs[flavor]
    with torch.device("meta"):
        model = DeepSeekV3(args)
    total, _ = param_counts(args)
    assert n_params(model, skip=("mtp.",)) == total
    assert n_params(model) - total == mtp_params(args)[0]


def test_published_sizes():
    # DeepSeek-V3 report: 671B parameters, 37B activated per token, the MTP module 14B (which in
    # DeepSeek's files includes copies of the embedding and output projection: 685B in all).
    v3 = deepseek_v3_configs["671B"]
    total, active = param_counts(v3)
    assert abs(total / 1e9 - 671) < 0.5 and abs(active / 1e9 - 37) < 1
    copies = 2 * v3.vocab_size * v3.dim
    assert abs((mtp_params(v3)[0] + copies) / 1e9 - 14) < 0.6
    # Moonlight-16B-A3B: 16B parameters, 3B activated; DeepSeek-V2-Lite (the same blocks with softmax
    # routing and a 102,400-token vocabulary): 15.7B, 2.4B activated without the embedding lookup.
    moonlight = deepseek_v3_configs["16B"]
    total, active = param_counts(moonlight)
    assert abs(total / 1e9 - 16) < 0.1 and abs(active / 1e9 - 3) < 0.15
    lite = dataclasses.replace(moonlight, vocab_size=102400, hidden_dim=10944, score_func="softmax", route_scale=1.0)
    total, active = param_counts(lite)
    assert abs(total / 1e9 - 15.7) < 0.05 and abs((active - lite.vocab_size * lite.dim) / 1e9 - 2.4) < 0.1


def test_debugmodel_has_every_part():
    model = build(**dataclasses.asdict(deepseek_v3_configs["debugmodel"]) | {"rope_scaling": None})
    blocks = list(model.layers.values())
    assert [b.moe is None for b in blocks] == [True, True, False, False]
    assert all(b.shared_experts is not None for b in blocks[2:]) and blocks[0].attention.wq_a is not None
    assert len(model.mtp) == 1 and model.mtp[0].block.moe is not None


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention


def reference_mla(attn, x, args, rope_table_):
    """MLA written out head by head with explicit scores, from the module's weights."""
    b, s, _ = x.shape
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))) if attn.wq is None else attn.wq(x)
    q = q.view(b, s, args.n_heads, args.qk_head_dim)
    latent, k_rope = attn.wkv_a(x).split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
    kv = attn.wkv_b(attn.kv_norm(latent)).view(b, s, args.n_heads, -1)
    k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], dim=-1)

    def rotate(t):  # adjacent pairs (t0, t1) rotated by each position's angles
        cos, sin = rope_table_[:s, :, 0], rope_table_[:s, :, 1]
        a, c = t[..., 0::2], t[..., 1::2]
        cos, sin = (u.view(s, *([1] * (t.dim() - 3)), -1) for u in (cos, sin))
        return torch.stack((a * cos - c * sin, a * sin + c * cos), dim=-1).flatten(-2)

    q = torch.cat([q[..., :args.qk_nope_head_dim], rotate(q[..., args.qk_nope_head_dim:])], dim=-1)
    k_rope = rotate(k_rope)  # (b, s, rope)
    out = torch.empty(b, s, args.n_heads, args.v_head_dim)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(args.n_heads):
        k = torch.cat([k_nope[:, :, h], k_rope], dim=-1)
        scores = (q[:, :, h] @ k.transpose(1, 2)) * args.softmax_scale()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[:, :, h] = weights @ v[:, :, h]
    return attn.wo(out.flatten(2))


@pytest.mark.parametrize("q_lora_rank", [0, 16])
@pytest.mark.parametrize("yarn", [False, True])
def test_latent_attention_equals_a_head_by_head_reference(q_lora_rank, yarn):
    scaling = YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.7) if yarn else None
    model = build(q_lora_rank=q_lora_rank, rope_scaling=scaling)
    args = model.args
    x = torch.randn(2, 12, args.dim)
    attn = model.layers["0"].attention
    with torch.no_grad():
        expected = reference_mla(attn, x, args, model.rope_cache)
        torch.testing.assert_close(attn(x, model.rope_cache), expected, rtol=1e-5, atol=1e-5)
        attn.pad_values = True  # the padded values that ring attention's kernels need change nothing
        torch.testing.assert_close(attn(x, model.rope_cache), expected, rtol=1e-5, atol=1e-5)
    if yarn:  # YaRN squares the mscale into the softmax scale
        m = 0.1 * 0.7 * math.log(4.0) + 1
        assert args.softmax_scale() == pytest.approx(args.qk_head_dim**-0.5 * m * m)


def test_yarn_rope_keeps_short_wavelengths_and_stretches_long_ones():
    args = DeepSeekV3ModelArgs(**{**TINY, "qk_rope_head_dim": 16, "rope_theta": 10000.0, "max_seq_len": 64})
    plain = rope_table(args)
    scaled = rope_table(dataclasses.replace(args, rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=16,
                                                                          mscale=1.0, mscale_all_dim=1.0)))
    angle = lambda t: torch.atan2(t[..., 1], t[..., 0])  # noqa: E731
    assert torch.allclose(angle(plain)[1, 0], angle(scaled)[1, 0])  # the fastest frequency is kept
    assert torch.allclose(angle(plain)[1, -1] / 8, angle(scaled)[1, -1], rtol=1e-4)  # the slowest is divided by 8


# ---------------------------------------------------------------------------------------------
# Multi-token prediction


def test_mtp_loss_is_the_mean_cross_entropy_of_each_depth_and_leaves_the_logits_alone():
    model = build(mtp_loss_weight=0.5)
    tokens = torch.randint(0, 64, (2, 10))
    labels = torch.randint(0, 64, (2, 10))
    logits_with = model(tokens, labels=labels)
    mtp = model.take_mtp_loss()
    torch.testing.assert_close(logits_with, model(tokens))  # the output is the main model's logits
    # Independently, on truncated sequences: depth k embeds the labels k - 1 ahead and predicts
    # those k ahead. Positions past the end never reach earlier ones (causal attention, per-token
    # routing), so cutting them off changes nothing the loss counts.
    seq = tokens.shape[1]
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
        for layer in model.layers.values():
            h = layer(h, model.rope_cache)
        losses = []
        for k, module in enumerate(model.mtp, start=1):
            emb = model.tok_embeddings(labels[:, k - 1:])
            x = module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h[:, :seq - k + 1])], dim=-1))
            h = module.block(x, model.rope_cache)
            logits = model.output(module.norm(h))[:, :seq - k]
            losses.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten()))
    # The model runs every position and masks; this runs fewer: other shapes, so other orders of the
    # sums of the main blocks and each depth's (hidden size 48, plus the router's and the latent
    # projections'), then the log-sum-exp over the vocabulary and the mean over the 20 tokens.
    forward = transformer_sums(n_layers=4 + 2, dim=32, hidden=48 + 32 + 8 + 16, seq=10, head_dim=12)
    assert mtp.item() == pytest.approx(sum(losses).item() / 2, rel=reordered_sums(torch.float32, forward + 64 + 20)["rtol"])


def test_mtp_gradient_reaches_its_modules_only_in_training_and_scales_with_its_weight():
    tokens, labels = torch.randint(0, 64, (2, 10)), torch.randint(0, 64, (2, 10))

    def grads(weight, train=True):
        model = build(mtp_loss_weight=weight)
        model.train(train)
        F.cross_entropy(model(tokens, labels=labels).flatten(0, 1), labels.flatten()).backward()
        return {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}

    off, on, evaluated = grads(0.0), grads(1.0), grads(1.0, train=False)
    assert on["mtp.0.eh_proj.weight"].abs().sum() > 0 and off["mtp.0.eh_proj.weight"].abs().sum() == 0
    assert evaluated["mtp.0.eh_proj.weight"] is None  # no MTP in evaluation
    # The main blocks get MTP's gradient too (through h); with weight 0 exactly the plain loss's.
    assert not torch.equal(on["layers.0.attention.wo.weight"], off["layers.0.attention.wo.weight"])
    torch.testing.assert_close(off["layers.0.attention.wo.weight"], evaluated["layers.0.attention.wo.weight"])


def test_mtp_loss_of_ranks_with_uneven_ignored_targets_averages_into_one_process_loss():
    """The trainer averages the ranks' losses (and gradients). Each rank divides its cross-entropy
    sum by the valid targets of every rank (the model's `sum_over_loss_ranks` seam) and multiplies
    by their number: the ranks' mean is then one process's mean over all targets, also when the
    ranks hold different numbers of them (masked labels; under context parallelism the last
    positions of each sequence lie on one rank). Two data-parallel "ranks" in this process, each
    given the other's count as a process group would sum it; a mean of the two per-rank means
    (what a mean per forward gives) misses by more than ten times the tolerance."""
    torch.manual_seed(2)
    tokens, labels = torch.randint(0, 64, (4, 12)), torch.randint(0, 64, (4, 12))
    labels[:2, 1:9] = -100  # rank 0's rows carry few targets, rank 1's many
    model = build(mtp_loss_weight=1.0)
    with torch.no_grad():
        model.output.weight.mul_(20)  # confident logits: the tokens' cross-entropies differ widely
    model(tokens, labels=labels)
    whole = model.take_mtp_loss()
    parts = [(tokens[:2], labels[:2]), (tokens[2:], labels[2:])]
    counts = [(model.labels_ahead(y, 2)[1:] != -100).flatten(1).sum(dim=1) for _, y in parts]
    ranks = []
    for rank, (x, y) in enumerate(parts):
        model.sum_over_loss_ranks = lambda c, other=counts[1 - rank]: c + other
        model.loss_ranks = 2
        model(x, labels=y)
        ranks.append(model.take_mtp_loss())
    model.sum_over_loss_ranks, model.loss_ranks = (lambda c: c), 1
    naive = []
    for x, y in parts:
        model(x, labels=y)
        naive.append(model.take_mtp_loss())
    # Rows in other batches: the blocks' sums over 2 rows instead of 4, and the cross-entropy's sum
    # over the targets split in two.
    forward = transformer_sums(n_layers=4 + 2, dim=32, hidden=48 + 32 + 8 + 16, seq=12, head_dim=12)
    rtol = reordered_sums(torch.float32, forward + 64 + 48)["rtol"]
    assert ((ranks[0] + ranks[1]) / 2).item() == pytest.approx(whole.item(), rel=rtol)
    print(f"ranks' mean {((ranks[0] + ranks[1]) / 2).item()}, one process {whole.item()}, mean of per-rank means "
          f"{((naive[0] + naive[1]) / 2).item()}")
    assert abs(((naive[0] + naive[1]) / 2 - whole).item()) > 10 * rtol * whole.item()


def test_labels_ahead_end_every_sequence_with_ignored_targets():
    labels = torch.arange(10).view(2, 5)
    ahead = labels_ahead(labels, 2)
    assert ahead.shape == (3, 2, 5) and torch.equal(ahead[0], labels)
    assert ahead[1, 0].tolist() == [1, 2, 3, 4, -100] and ahead[2, 1].tolist() == [7, 8, 9, -100, -100]


# ---------------------------------------------------------------------------------------------
# Refusals (one line each, before start-up)


def _preflight(*args, world_size=1):
    return preflight(parse_args([*TINY_RUN, "--model.name", "deepseek_v3", "--model.flavor", "tiny", *args]),
                     world_size=world_size, device_type="cpu", check_memory=False)


def test_mtp_with_context_parallelism_is_accepted():
    """MTP takes the labels ahead from the next chunk's cp rank (test_mtp_context_parallel.py)."""
    assert _preflight("--experimental.context_parallel_degree", "2", world_size=2).model_args.mtp_depth == 1


def test_mtp_depth_for_a_family_without_mtp_is_refused():
    config = parse_args([*TINY_RUN, "--model.mtp_depth", "1"])
    with pytest.raises(ConfigError, match="has no multi-token prediction"):
        preflight(config, world_size=1, device_type="cpu", check_memory=False)


def test_mtp_depth_option_overrides_the_flavor():
    assert _preflight("--model.mtp_depth", "2").model_args.mtp_depth == 2
    assert _preflight().model_args.mtp_depth == deepseek_v3_configs["tiny"].mtp_depth


def test_float8_rowwise_with_tp_is_accepted():
    """TP keeps its plain styles under a rowwise recipe, so the tensorwise refusal does not apply."""
    assert _preflight("--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe", "rowwise",
                      "--training.tensor_parallel_degree", "2", world_size=2).parallel_dims.tp == 2


@pytest.mark.parametrize("args,message", [
    (("--model.mtp_depth", "4", "--training.seq_len", "4"), "needs training.seq_len above it"),
    (("--float8.enable_float8_linear", "--float8.emulate", "--training.tensor_parallel_degree", "2"),
     "no float8 tensor-parallel plan"),
    (("--training.tensor_parallel_degree", "3"), "must divide"),
])
def test_layouts_the_family_cannot_run_are_refused_in_one_line(args, message):
    world = 3 if "3" in args else 2 if "2" in args else 1
    with pytest.raises(ConfigError, match=message) as refusal:
        _preflight(*args, world_size=world)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("option,value,line", [
    ("--model.mtp_depth", "-2", "model.mtp_depth must be -1 (the flavor's), 0 (off) or a depth, got -2"),
    # Each option is named with its own range (the weight's refusal once led with mtp_depth).
    ("--model.mtp_loss_weight", "-0.1", "model.mtp_loss_weight must be >= 0 (the multi-token prediction loss's "
     "weight; 0 leaves it out of the training loss), got -0.1")])
def test_bad_mtp_options_are_refused_when_parsed(option, value, line):
    with pytest.raises(ConfigError) as refused:
        parse_args([*TINY_RUN, option, value])
    assert refused.value.line == f"error: {line}"
