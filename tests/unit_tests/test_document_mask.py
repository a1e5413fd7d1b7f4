"""Document masking (training.document_mask): document ids from tokens, the block-causal mask and
both kernels (SDPA with an additive mask; FlexAttention, forced on CPU where it runs eagerly, forward
only), both model families (Llama, Qwen3 dense and MoE): a packed window of three documents gives
each document the logits (and gradients) it gets alone, and no mask, or one document, is plain
causal attention. Also the preflight's refusals and what the training step passes the model."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import assert_reordered, reordered_sums, transformer_sums
from torchtitan.models.common import causal_attention, document_causal_mask, document_ids
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.qwen3.model import Qwen3, Qwen3ModelArgs

EOS, BOS, VOCAB = 2, 1, 100
LLAMA = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32, multiple_of=16)
QWEN3 = Qwen3ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=VOCAB,
                       max_seq_len=32)
QWEN3_MOE = Qwen3ModelArgs(**{**QWEN3.__dict__, "num_experts": 4, "top_k": 2, "moe_hidden_dim": 32})
MODELS = {"llama": (Transformer, LLAMA), "qwen3": (Qwen3, QWEN3), "qwen3_moe": (Qwen3, QWEN3_MOE)}
# Three documents of a 32-token window, each BOS ... EOS (the last one cut by the window's end).
DOC_LENGTHS = (9, 14, 9)
# The sums of a forward of the largest of them (Llama's: feed-forward hidden size 176, head dim 16) at
# 32 tokens. The paths compared run every matmul on other row counts or another attention kernel.
FORWARD_SUMS = transformer_sums(n_layers=2, dim=64, hidden=176, seq=32, head_dim=16)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    cls, args = MODELS[name]
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def documents(seed: int = 0, lengths: tuple[int, ...] = DOC_LENGTHS) -> list[torch.Tensor]:
    """Token rows BOS, text..., EOS (text tokens never 1 or 2); the last document has no EOS."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, n in enumerate(lengths):
        doc = torch.randint(3, VOCAB, (n,), generator=g)
        doc[0] = BOS
        if i < len(lengths) - 1:
            doc[-1] = EOS
        docs.append(doc)
    return docs


def flex_forced(model: torch.nn.Module) -> torch.nn.Module:
    model.attention_mask = functools.partial(document_causal_mask, flex=True)
    return model


def test_document_ids_count_the_end_of_text_tokens_before_each_position():
    tokens = torch.tensor([[7, 8, EOS, BOS, 5, EOS, BOS, 6],  # starts mid-document: its head is document 0
                           [BOS, 4, 4, 4, 4, 4, 4, EOS],       # no document starts inside: all document 0
                           [EOS, EOS, 3, 3, EOS, 3, 3, 3]])     # an end-of-text first: document 0 is one token
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2],
                                                  [0, 0, 0, 0, 0, 0, 0, 0],
                                                  [0, 1, 2, 2, 2, 3, 3, 3]]
    assert document_ids(tokens, EOS).dtype == torch.int32


def test_sdpa_mask_is_causal_within_each_document():
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    mask = document_causal_mask(ids)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}
    assert (mask[0, 0] == 0).int().tolist() == [[1, 0, 0, 0, 0],
                                                [1, 1, 0, 0, 0],
                                                [0, 0, 1, 0, 0],
                                                [0, 0, 1, 1, 0],
                                                [0, 0, 1, 1, 1]]


def test_the_additive_mask_gives_what_a_boolean_mask_gives():
    """The mask is additive (made once per forward, shared by every block) rather than boolean
    (which SDPA converts to the same float mask in every block, keeping each copy for backward):
    outputs and gradients are bit for bit those of the boolean mask."""
    ids = torch.tensor([[0] * 6 + [1] * 7 + [2] * 3, [0] * 16])
    allowed = document_causal_mask(ids) == 0
    results = []
    for mask in (allowed, document_causal_mask(ids)):
        q, k, v = (torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(i)).requires_grad_()
                   for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for boolean, additive in zip(*results):
        assert torch.equal(boolean, additive)


@pytest.mark.parametrize("name", MODELS)
def test_packed_documents_get_the_logits_of_separate_runs(name):
    """RoPE scores depend on relative positions only, so a document later in the window needs no
    position reset: masked, it sees exactly what it sees alone."""
    model = build(name)
    docs = documents()
    packed = torch.cat(docs).unsqueeze(0)
    with torch.no_grad():
        logits = model(packed, document_ids=document_ids(packed, EOS))
        alone = torch.cat([model(doc.unsqueeze(0)) for doc in docs], dim=1)
        unmasked = model(packed)
    diff = (logits - alone).abs().max().item()
    print(f"{name}: max |logit diff| packed+masked vs separate {diff:.2e}")
    assert_reordered(logits, alone, FORWARD_SUMS)
    # Without the mask the later documents see the earlier ones: the test can fail.
    assert (unmasked[:, DOC_LENGTHS[0]:] - alone[:, DOC_LENGTHS[0]:]).abs().max() > 1e-3


def test_packed_gradients_are_the_sum_of_separate_gradients():
    """Training through the boolean-mask SDPA: the loss summed over a packed window has the
    gradients of the documents' losses summed over separate runs."""
    docs = documents(seed=1)
    packed_model, separate_model = build("llama"), build("llama")
    packed = torch.cat(docs).unsqueeze(0)
    logits = packed_model(packed[:, :-1], document_ids=document_ids(packed[:, :-1], EOS))
    F.cross_entropy(logits.flatten(0, 1), packed[0, 1:], reduction="sum").backward()
    # Alone, each document predicts its own next tokens; the packed window also predicts each next
    # document's BOS from the EOS before it (the EOS sees only its own document).
    for i, doc in enumerate(docs):
        targets = torch.cat([doc[1:], docs[i + 1][:1]]) if i + 1 < len(docs) else doc[1:]
        inputs = doc if i + 1 < len(docs) else doc[:-1]
        out = separate_model(inputs.unsqueeze(0))
        F.cross_entropy(out.flatten(0, 1), targets, reduction="sum").backward()
    # Each difference relative to its tensor's largest gradient: a backward runs the forward's sums
    # again and sums each weight's gradient over the 32 tokens.
    worst = max((a.grad - b.grad).abs().max().item() / b.grad.abs().max().item()
                for a, b in zip(packed_model.parameters(), separate_model.parameters()))
    assert worst < reordered_sums(torch.float32, 2 * FORWARD_SUMS + 32)["rtol"], worst


@pytest.mark.parametrize("name", MODELS)
def test_flex_attention_path_matches_the_boolean_mask_path(name):
    """Two packings per batch (rows differ), FlexAttention's BlockMask against SDPA's boolean mask."""
    model = build(name)
    rows = torch.stack([torch.cat(documents(seed=2)), torch.cat(documents(seed=3, lengths=(20, 3, 9)))])
    ids = document_ids(rows, EOS)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention asks to be compiled (it is, on CUDA)
        sdpa = model(rows, document_ids=ids)
        flex = flex_forced(model)(rows, document_ids=ids)
    diff = (flex - sdpa).abs().max().item()
    print(f"{name}: max |logit diff| flex vs SDPA mask {diff:.2e}")
    assert_reordered(flex, sdpa, FORWARD_SUMS)


@pytest.mark.parametrize("name", MODELS)
def test_one_document_is_plain_causal_attention(name):
    """A window without an end-of-text token is one document: both mask paths give the logits of
    plain causal attention."""
    model = build(name)
    tokens = torch.randint(3, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    ids = document_ids(tokens, EOS)
    assert not ids.any()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model(tokens)
        masked = model(tokens, document_ids=ids)
        flex = flex_forced(build(name))(tokens, document_ids=ids)
    assert_reordered(masked, plain, FORWARD_SUMS)
    assert_reordered(flex, plain, FORWARD_SUMS)


def test_without_document_ids_the_model_is_unchanged():
    """document_ids None is today's path, bit for bit: the kernel runs SDPA's own causal mode."""
    model = build("llama")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens, document_ids=None))
        q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
        assert torch.equal(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_masked_kernel_keeps_the_cpu_upcast_of_bf16():
    """bf16 on CPU is computed in fp32 with the mask as without it, and grouped-query heads work."""
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    mask = document_causal_mask(torch.tensor([[0] * 5 + [1] * 11, [0] * 16]))
    low = [t.bfloat16() for t in (q, k, v)]
    out = causal_attention(*low, mask)
    assert out.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(*(t.float() for t in low), attn_mask=mask, enable_gqa=True)
    assert torch.equal(out, expected.bfloat16())


def test_the_training_step_passes_document_ids_only_with_the_option():
    """Off, the model gets the tokens alone (today's call); on, the ids of the whole sequences."""
    from torchtitan.config.manager import parse_args
    from torchtitan.trainer.step import document_mask_eos, model_kwargs

    class Vocabulary:
        eos_id = EOS

    tokens = torch.tensor([[BOS, 5, EOS, BOS, 6]])
    assert document_mask_eos(parse_args([]), Vocabulary()) is None
    assert model_kwargs(tokens, None) == {}
    eos_id = document_mask_eos(parse_args(["--training.document_mask"]), Vocabulary())
    assert eos_id == EOS and model_kwargs(tokens, eos_id)["document_ids"].tolist() == [[0, 0, 0, 1, 1]]


@pytest.mark.parametrize("eos_id", [-1, None])
def test_a_tokenizer_without_end_of_text_is_refused(eos_id):
    """Sentencepiece models may have no end-of-text piece (eos_id -1): nothing to cut documents at."""
    from torchtitan.config.manager import ConfigError, parse_args
    from torchtitan.config.preflight import check_document_mask

    class Vocabulary:
        pass

    tokenizer = Vocabulary()
    if eos_id is not None:
        tokenizer.eos_id = eos_id
    check_document_mask(parse_args([]), tokenizer)  # off: no end-of-text needed
    with pytest.raises(ConfigError, match=f"training.document_mask needs an end-of-text token .* \\(eos_id {eos_id}\\)"):
        check_document_mask(parse_args(["--training.document_mask"]), tokenizer)


def test_a_model_that_takes_no_document_ids_is_refused():
    from torchtitan.config.manager import ConfigError, parse_args
    from torchtitan.config.preflight import check_document_mask

    class Vocabulary:
        eos_id = EOS

    class OldModel(torch.nn.Module):
        def forward(self, tokens):
            return tokens

    on = parse_args(["--training.document_mask"])
    check_document_mask(on, Vocabulary(), Transformer)
    check_document_mask(on, Vocabulary(), Qwen3)
    with pytest.raises(ConfigError, match="model 'llama3' takes no document_ids in its forward"):
        check_document_mask(on, Vocabulary(), OldModel)
