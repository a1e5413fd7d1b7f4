"""training.loss_chunk_size (parallelisms/chunked_loss.py): the chunked head's loss and gradients
equal the plain path's (whole logits, models/loss.py) in fp32, with ignored labels and a padded
vocabulary, and no tensor the size of the whole logits ever exists, forward or backward."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from tests.tolerances import assert_reordered
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.models import get_train_spec
from torchtitan.models.common import PaddedVocabMask
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.parallelisms.chunked_loss import ChunkedLossHead, install_chunked_loss
from torchtitan.runtime.torch_compat.dispatch import TorchDispatchMode

BATCH, SEQ, DIM, VOCAB, PADDING, CHUNK = 2, 24, 8, 250, 6, 5  # 24 = 4 chunks of 5 and one of 4
# DIM is small so that the weight (vocab x dim) is smaller than one chunk's logits: the size check sees logits.


def head_sums(dim: int) -> int:
    """The sums the chunked head orders otherwise than the whole-logits path: each logit over the
    model's dim, each log-sum-exp over the padded vocabulary, the loss over the batch's tokens."""
    return dim + VOCAB + PADDING + BATCH * SEQ


class LargestOutput(TorchDispatchMode):
    """The most elements any op's output had while active (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(BATCH, SEQ, DIM, generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :7] = -100  # ignored positions, some in a chunk of their own
    labels[1, -3:] = -100
    weight = torch.randn(VOCAB + PADDING, DIM, generator=gen) * 0.3
    return h, labels, weight


def _plain(h, labels, weight):
    output = nn.Linear(DIM, VOCAB + PADDING, bias=False)
    output.weight = nn.Parameter(weight.clone())
    h = h.clone().requires_grad_()
    loss = cross_entropy_loss(PaddedVocabMask(VOCAB)(output(h)), labels)
    loss.backward()
    return loss.detach(), h.grad, output.weight.grad


def _chunked(h, labels, weight, mode: TorchDispatchMode | None = None):
    output = nn.Linear(DIM, VOCAB + PADDING, bias=False)
    output.weight = nn.Parameter(weight.clone())
    head = ChunkedLossHead(output, PaddedVocabMask(VOCAB), CHUNK)
    assert head.weight is output.weight  # the model's own Parameter: names and ties unchanged
    h = h.clone().requires_grad_()
    head.labels = labels
    if mode is None:
        loss = head(h)
        loss.backward()
    else:
        with mode:
            loss = head(h)
            loss.backward()
    assert head.labels is None  # consumed: the next forward without labels gives logits
    return loss.detach(), h.grad, head.weight.grad


def test_loss_and_gradients_equal_the_whole_logits_path():
    plain, chunked = _plain(*_inputs()), _chunked(*_inputs())
    for name, a, b in zip(("loss", "hidden-state grad", "weight grad"), plain, chunked):
        assert_reordered(b, a, head_sums(DIM), msg=f"{name} differs")
    assert plain[2][VOCAB:].abs().max() == 0 and chunked[2][VOCAB:].abs().max() == 0  # padding rows get none


def test_no_whole_logits_tensor_exists():
    whole = BATCH * SEQ * (VOCAB + PADDING)
    chunked = LargestOutput()
    _chunked(*_inputs(), mode=chunked)
    assert chunked.largest <= BATCH * CHUNK * (VOCAB + PADDING)
    plain = LargestOutput()  # the same measure sees the plain path's whole logits
    with plain:
        _plain(*_inputs())
    assert plain.largest >= whole


def test_without_labels_the_head_returns_masked_logits():
    h, _, weight = _inputs()
    output = nn.Linear(DIM, VOCAB + PADDING, bias=False)
    output.weight = nn.Parameter(weight)
    head = ChunkedLossHead(output, PaddedVocabMask(VOCAB), CHUNK)
    torch.testing.assert_close(head(h), PaddedVocabMask(VOCAB)(output(h)), rtol=0, atol=0)


@pytest.mark.parametrize("name,flavor", [("llama3", "tiny"), ("llama3", "tiny_tied"), ("qwen3", "tiny"),
                                         ("deepseek_v3", "tiny")])
def test_installed_in_each_family_the_forward_takes_labels(name, flavor):
    """Every family's model, its labels delivered by the forward pre-hook (kept for DeepSeek-V3's own
    `labels`): the loss and every parameter's gradient equal the plain model's; the state dict's
    names and a tied weight are unchanged; without labels the forward gives logits."""
    spec = get_train_spec(name)
    args = dataclasses.replace(spec.config[flavor], vocab_size=VOCAB, max_seq_len=SEQ)
    if hasattr(args, "vocab_padding"):
        args = dataclasses.replace(args, vocab_padding=PADDING)
    if hasattr(args, "mtp_depth"):
        args = dataclasses.replace(args, mtp_depth=0)  # refused with MTP (test_refused_with_multi_token_prediction)
    torch.manual_seed(0)
    plain = spec.model_cls.from_model_args(args)
    plain.init_weights()
    chunked = copy.deepcopy(plain)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    _, labels, _ = _inputs()
    names = list(plain.state_dict())
    install_chunked_loss(chunked, CHUNK)
    assert list(chunked.state_dict()) == names
    if flavor.endswith("_tied"):
        assert chunked.output.weight is chunked.tok_embeddings.weight
    loss = cross_entropy_loss(plain(tokens), labels)
    loss.backward()
    chunked_loss = chunked(tokens, labels=labels)
    chunked_loss.backward()
    # The blocks run the same ops on the same shapes; only the head's sums are ordered otherwise, and
    # the blocks' gradients carry that rounding of the hidden state's gradient, at their own scale.
    assert_reordered(chunked_loss, loss, head_sums(args.dim))
    for (n, a), b in zip(plain.named_parameters(), chunked.parameters()):
        assert_reordered(b.grad, a.grad, head_sums(args.dim), msg=n)
    assert chunked(tokens).shape[:2] == (BATCH, SEQ)  # no labels: logits, as before


def test_refusals():
    class WithBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.output = nn.Linear(4, 8)

    with pytest.raises(ConfigError, match="training.loss_chunk_size"):
        install_chunked_loss(WithBias(), 4)
    config = JobConfig()
    config.training.loss_chunk_size = -1
    from torchtitan.config.sections import check_training

    with pytest.raises(ConfigError, match="training.loss_chunk_size must be >= 0"):
        check_training(config)


def test_refused_with_multi_token_prediction():
    from torchtitan.config.preflight import check_mtp

    config = JobConfig()
    config.model.name, config.model.flavor = "deepseek_v3", "tiny"  # the flavor's MTP depth is 1
    config.training.loss_chunk_size = 16
    spec = get_train_spec("deepseek_v3")
    with pytest.raises(ConfigError, match="training.loss_chunk_size does not compose with multi-token prediction"):
        check_mtp(config, spec)
    config.model.mtp_depth = 0
    check_mtp(config, spec)  # MTP off: allowed


@pytest.mark.parametrize("name,flavor,depth,weight,said", [
    ("llama3", "tiny", -1, 0.5, True),  # a family without MTP
    ("deepseek_v3", "tiny", 0, 0.5, True),  # MTP turned off
    ("deepseek_v3", "tiny", -1, 0.5, False),  # the flavor's MTP weighs it
    ("llama3", "tiny", -1, 0.3, False),  # the default says nothing
])
def test_an_mtp_loss_weight_without_mtp_gets_a_notice(name, flavor, depth, weight, said, caplog, monkeypatch):
    from torchtitan.config.preflight import check_mtp

    monkeypatch.delenv("RANK", raising=False)
    config = JobConfig()
    config.model.name, config.model.flavor, config.model.mtp_depth, config.model.mtp_loss_weight = name, flavor, depth, weight
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        check_mtp(config, get_train_spec(name))
    notices = [r.getMessage() for r in caplog.records if "mtp_loss_weight" in r.getMessage()]
    assert notices == ([f"notice: model.mtp_loss_weight {weight} has no effect: it weighs the multi-token prediction "
                        f"loss, and model {name} {flavor} has none in this job (model.mtp_depth 0)"] if said else [])


def test_the_measurement_script_counts_less_for_chunks():
    """scripts/loss_memory.py (docs/memory.md's table) on fake and on real tensors: the same count,
    and the chunked loss's peak below the whole logits' by about the chunks' share."""
    from scripts.loss_memory import measure

    rows = {(chunk, real): measure(4096, 8, 256, chunk, torch.float32, real, 1)
            for chunk in (0, 32) for real in (False, True)}
    for chunk in (0, 32):
        assert rows[chunk, False]["peak_bytes"] == rows[chunk, True]["peak_bytes"]
    assert rows[32, True]["loss_peak_bytes"] < rows[0, True]["loss_peak_bytes"] / 4
