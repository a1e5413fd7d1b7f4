"""Generation (torchtitan/inference/generation.py) in one process on tiny random models: the KV cache gives
the logits of re-running the whole sequence, left padding leaves every row as it would be alone,
and sampling keeps exactly the tokens temperature, top-k and top-p allow."""

import dataclasses

import pytest
import torch

from tests.tolerances import assert_reordered, largest_difference, transformer_sums
from torchtitan.inference.generation import (
    Continuation,
    KVCache,
    Sampling,
    filter_logits,
    generate,
    left_pad,
    reference_logits,
    sample,
)
from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.deepseek_v3.model import Attention, DeepSeekV3, DeepSeekV3ModelArgs, YarnScaling
from torchtitan.models.gpt_oss.model import GptOss, GptOssModelArgs
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.qwen3.model import Qwen3, Qwen3ModelArgs

MODELS = {
    "llama_gqa": lambda: Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                                               multiple_of=32, max_seq_len=64)),
    "llama_padded_vocab": lambda: Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, vocab_padding=20,
                                                        multiple_of=32, max_seq_len=64)),
    "qwen3_moe": lambda: Qwen3(Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                         vocab_size=300, max_seq_len=64, num_experts=4, top_k=2,
                                                         moe_hidden_dim=32)),
    # Latent attention: values have their own head size (6) beside the keys' (8 + 4); MTP is off in evaluation.
    "deepseek_v3": lambda: DeepSeekV3(DeepSeekV3ModelArgs(dim=64, n_layers=2, n_dense_layers=1, n_heads=4, hidden_dim=96,
                                                          vocab_size=300, max_seq_len=64, q_lora_rank=16,
                                                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                          v_head_dim=6, num_experts=4, top_k=2, moe_hidden_dim=32,
                                                          score_func="sigmoid", mtp_depth=1)),
    # Sinks, and banded blocks whose 5-position window the 20-token sequences and the prompts outgrow:
    # the caching kernel must drop what falls out of the window, and weigh the sinks.
    "gpt_oss": lambda: GptOss(GptOssModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=300,
                                              max_seq_len=64, sliding_window=5, num_experts=4, top_k=2,
                                              moe_hidden_dim=32)),
}


# The sums of a forward of the largest model above (Llama's feed-forward hidden size 192) at 20
# tokens: the cache runs every matmul on one row and attends through it, the reference on the whole.
FORWARD_SUMS = transformer_sums(n_layers=2, dim=64, hidden=192, seq=20, head_dim=16)


def model_named(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.init_weights()
    with torch.no_grad():  # gpt-oss starts its sinks at zero: give each head its own
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model.eval()


# (DeepSeek-V3's latent cache: test_the_latent_cache_gives_the_models_own_logits_and_greedy_tokens.)
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"deepseek_v3"}))
def test_cached_logits_equal_rerunning_the_whole_sequence(name):
    model = model_named(name)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 20, dtype=torch.bool)
    with KVCache(model, real, 20) as cache:
        steps = [cache.forward(tokens[:, :8])[:, -1]] + [cache.forward(tokens[:, t:t + 1])[:, -1] for t in range(8, 19)]
    # The cache is gone afterwards: the model's own kernels and full RoPE table are back.
    for t, cached in zip(range(8, 20), steps):
        assert_reordered(cached, reference_logits(model, tokens[:, :t])[:, -1], FORWARD_SUMS)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_greedy_tokens_with_and_without_the_cache_are_the_same(name):
    model = model_named(name)
    prompts = [[1, 5, 9, 200, 17], [1, 40], [1, 7, 7, 7, 7, 7, 7, 8, 9]]
    cached = torch.stack(list(generate(model, prompts, 12, Sampling(), eos_id=None)))
    rerun = torch.stack(list(generate(model, prompts, 12, Sampling(), eos_id=None, kv_cache=False)))
    # Equal tokens although the logits differ by rounding: these seeded models' top two logits are
    # at least 0.018 apart at every step, far beyond the bound above.
    assert torch.equal(cached, rerun)
    # Left padding changes nothing for a row: each prompt alone gives its row's tokens.
    for i, prompt in enumerate(prompts):
        alone = torch.stack(list(generate(model, [prompt], 12, Sampling(), eos_id=None)))
        assert torch.equal(alone[:, 0], cached[:, i])


# Latent attention's cache (the latents, not every head's keys and values; later tokens attend in the
# latent space) on the tiny and debug flavors (compressed queries), and on tiny with full queries,
# YaRN (mscale_all_dim below 1, so that the softmax scale differs from 1/sqrt(qk head dim)) and a
# padded vocabulary. 32 RoPE rows: the prompts and new tokens below fill 15.
_TINY = dataclasses.replace(deepseek_v3_configs["tiny"], max_seq_len=32)
LATENT_FLAVORS = {
    "tiny": _TINY,
    "debugmodel": dataclasses.replace(deepseek_v3_configs["debugmodel"], max_seq_len=32),
    "tiny_full_q_yarn_padded_vocab": dataclasses.replace(
        _TINY, q_lora_rank=0, vocab_padding=24,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale_all_dim=0.8)),
}


def latent_attention_sums(a: DeepSeekV3ModelArgs, seq: int) -> int:
    """transformer_sums of a DeepSeek-V3 forward, both ways of attending counted: the model's (scores
    over the qk head dim) and the latent space's (the queries' absorption over qk_nope_head_dim, scores
    over kv_lora_rank + qk_rope_head_dim, the values' W_UV over kv_lora_rank); beside the feed-forward's
    widest hidden size, the router's sums over dim and the latents' norms and projections."""
    attention = a.qk_head_dim + a.qk_nope_head_dim + 2 * a.kv_lora_rank + a.qk_rope_head_dim
    hidden = max(a.hidden_dim, a.moe_hidden_dim * a.n_shared_experts) + a.dim + a.q_lora_rank + 2 * a.kv_lora_rank
    return transformer_sums(a.n_layers, a.dim, hidden, seq, attention)


@pytest.mark.parametrize("flavor", sorted(LATENT_FLAVORS))
def test_the_latent_cache_gives_the_models_own_logits_and_greedy_tokens(flavor):
    """Prompts of three lengths in one batch; at every step each row's cached logits are those of the
    model's own forward (no cache, no padding) over that row's tokens so far, and the greedy token is
    that forward's: the tokens of generation with every head's keys and values cached, or none."""
    args = LATENT_FLAVORS[flavor]
    # A seed whose models' best logit leads the next by more than twice the bound at every step (checked
    # below); at some steps of seeds 0, 2 and 3 it does not, and rounding could then pick either token.
    torch.manual_seed(1)
    model = DeepSeekV3(args)
    model.init_weights()
    model.eval()
    prompts, new = [[1, 5, 9, 200, 17, 3], [1, 40], [1, 7, 7, 7, 7, 7, 7, 8, 9]], 6
    tokens, real = left_pad(prompts, 0, torch.device("cpu"))
    real = torch.cat([real, torch.ones(len(prompts), new, dtype=torch.bool)], dim=1)
    with KVCache(model, real, real.shape[1]) as cache:
        steps = [cache.forward(tokens)[:, -1]]
        for _ in range(new):
            steps.append(cache.forward(steps[-1].argmax(-1)[:, None])[:, -1])
    cached = torch.stack(steps, dim=1)  # (rows, prompt + each new token, vocab)
    chosen = cached[:, :-1].argmax(-1)
    vocab, terms = args.vocab_size, latent_attention_sums(args, real.shape[1])
    for row, prompt in enumerate(prompts):
        # One forward of the whole row: causal, so position i's logits are those of the tokens up to i.
        whole = torch.tensor([prompt + chosen[row].tolist()])
        expected = reference_logits(model, whole)[0, len(prompt) - 1:]
        assert torch.equal(cached[row, :, vocab:], expected[:, vocab:])  # the padded vocabulary's -inf
        assert_reordered(cached[row, :, :vocab], expected[:, :vocab], terms)
        print(f"{flavor} row {row}: max |cached - own forward| {(cached[row] - expected)[:, :vocab].abs().max():.1e}")
        # The greedy tokens are the forward's, and no rounding within the tolerance could change them:
        # at every step the forward's best logit leads the next by more than twice the tolerance.
        top2 = expected[:-1, :vocab].topk(2).values
        bound = largest_difference(torch.float32, terms, float(expected[:, :vocab].abs().max()))
        assert torch.equal(expected[:-1].argmax(-1), chosen[row])
        assert (top2[:, 0] - top2[:, 1] > 2 * bound).all(), (top2[:, 0] - top2[:, 1]).min()


def test_the_cache_holds_the_latents_the_script_counts():
    """scripts/kv_cache_memory.py (docs/generation.md's table): its count of every head's keys and
    values per token is the model's (Attention.expand's outputs, 671B's shapes on the meta device), and
    the tiny flavor's cache in bf16, after a prompt and a decoding step, holds exactly the latent count
    for each row and position of the main blocks: the MTP module's attention never runs."""
    from scripts.kv_cache_memory import measured, per_token

    big = deepseek_v3_configs["671B"]
    with torch.device("meta"):
        attention = Attention(big)
        k, v = attention.expand(torch.empty(1, 1, big.kv_lora_rank), torch.empty(1, 1, 1, big.qk_rope_head_dim))
    count = per_token(big, torch.bfloat16)
    assert count.per_head_elements == k.numel() + v.numel() and count.layers == big.n_layers
    tiny = deepseek_v3_configs["tiny"]
    assert tiny.mtp_depth > 0
    assert measured(tiny, 2, 8, torch.bfloat16) == 2 * 8 * per_token(tiny, torch.bfloat16).latent_bytes


def test_a_padded_row_sees_no_padding():
    model = model_named("llama_gqa")
    tokens, real = left_pad([[3, 4, 5, 6], [9, 8]], pad=0, device=torch.device("cpu"))
    assert tokens.tolist() == [[3, 4, 5, 6], [0, 0, 9, 8]] and real.tolist()[1] == [False, False, True, True]
    with KVCache(model, real, 4) as cache:
        padded = cache.forward(tokens)[1, -1]
    assert_reordered(padded, reference_logits(model, torch.tensor([[9, 8]]))[0, -1], FORWARD_SUMS)


def test_generation_stops_at_eos_per_row():
    model = model_named("llama_gqa")
    prompts = [[1, 2, 3], [4, 5]]
    free = torch.stack(list(generate(model, prompts, 6, Sampling(), eos_id=None)))
    eos = int(free[1, 0])  # row 0's second token, taken as EOS
    steps = torch.stack(list(generate(model, prompts, 6, Sampling(), eos_id=eos)))
    for row in range(2):
        first = (free[:, row] == eos).nonzero()
        end = int(first[0]) if len(first) else 6
        assert torch.equal(steps[: end + 1, row], free[: end + 1, row])
        assert (steps[end:, row] == eos).all()


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(logits, Sampling()), logits.argmax(-1))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, Sampling(temperature=1.5, top_k=1), g), logits.argmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), Sampling(temperature=1.0, top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = filter_logits(probs.log(), Sampling(temperature=1.0, top_p=0.81)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    kept = filter_logits(probs.log(), Sampling(temperature=1.0, top_p=0.4)).isfinite()
    assert kept.tolist() == [[True, False, False, False]]  # the likeliest token always stays


def test_a_seed_repeats_a_sample_and_masked_rows_are_never_drawn():
    logits = torch.zeros(3, 40)
    logits[:, 30:] = float("-inf")  # a padded vocabulary's rows, as the model masks them
    s = Sampling(temperature=1.0)
    a = [sample(logits, s, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    draws = torch.cat([sample(logits, s, torch.Generator().manual_seed(k)) for k in range(200)])
    assert draws.max() < 30 and len(draws.unique()) > 20


@pytest.mark.parametrize("bad,message", [
    (Sampling(temperature=-1), "temperature must be >= 0"),
    (Sampling(temperature=float("nan")), "temperature must be >= 0"),
    (Sampling(top_k=-2), "top-k must be >= 0"),
    (Sampling(top_p=0), "top-p must lie in (0, 1]"),
    (Sampling(top_p=1.5), "top-p must lie in (0, 1]"),
])
def test_impossible_sampling_is_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        bad.check()


def test_extreme_temperatures_give_argmax_or_uniform_never_nan():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    tiny = filter_logits(logits, Sampling(temperature=1e-45)).softmax(-1)
    assert not tiny.isnan().any() and torch.equal(tiny.argmax(-1), logits.argmax(-1)) and torch.all(tiny.max(-1).values == 1)
    flat = filter_logits(logits, Sampling(temperature=float("inf"))).softmax(-1)
    torch.testing.assert_close(flat, torch.full_like(flat, 1 / 50))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_past_the_tokenizer_are_never_generated(temperature):
    """A model's vocabulary may be larger than its tokenizer's (published folders pad it): the ids
    the tokenizer cannot decode are never drawn, even where the model favours them."""
    model = model_named("llama_gqa")
    with torch.no_grad():
        model.output.weight[250:] *= 50  # the ids above 250 would win
    out = torch.stack(list(generate(model, [[1, 5, 9]], 30, Sampling(temperature=temperature), eos_id=None,
                                    vocab_limit=250)))
    assert out.max() < 250


@pytest.mark.parametrize("name,multiple", [("qwen3_moe", 2), ("qwen3_moe", 3), ("deepseek_v3", 2)])
def test_forwards_padded_to_a_multiple_give_the_same_tokens(name, multiple):
    """What tensor-parallel MoE generation does (each forward padded to the number of ranks), in one
    process: the padding is never attended to, so the tokens are those of unpadded forwards. (For
    latent attention, decoding forwards of two positions attend in the latent space.)"""
    model = model_named(name)
    prompts = [[1, 5, 9, 200, 17], [1, 40]]
    plain = torch.stack(list(generate(model, prompts, 12, Sampling(), eos_id=None)))
    for kv_cache in (True, False):
        padded = torch.stack(list(generate(model, prompts, 12, Sampling(), eos_id=None, kv_cache=kv_cache,
                                           multiple_of=multiple)))
        assert torch.equal(padded, plain)


class ByteTokenizer:
    """UTF-8 bytes as tokens (a character can span several), with sentencepiece's habit of spelling
    a word's leading space into its first piece and dropping it at the start of a decode."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace").removeprefix(" ")


def test_a_continuation_keeps_its_leading_space_and_streams_whole_characters():
    tok = ByteTokenizer()
    prompt = list("The café".encode())
    continuation = list(" crème ✓ done".encode())
    text = Continuation(tok, prompt, eos_id=None)
    pieces = [text.new_text(continuation[:n]) for n in range(1, len(continuation) + 1)]
    assert "".join(pieces) + text.new_text(continuation, final=True) == " crème ✓ done"
    assert all("\ufffd" not in piece for piece in pieces)  # a half-arrived character waits for its last byte
    assert Continuation(tok, prompt, eos_id=None).new_text(continuation, final=True) == " crème ✓ done"
