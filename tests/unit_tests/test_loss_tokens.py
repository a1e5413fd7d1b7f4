"""The loss as a mean over the step's tokens that carry one (trainer/loss_tokens.py): masked labels,
micro-batches and data-parallel ranks holding different counts, all-masked micro-batches, and the
end-of-text label mask that produces such labels (training.mask_loss_after_eos)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import assert_reordered
from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.config.preflight import check_document_mask
from torchtitan.datasets.text_dataset import IGNORE_INDEX, PackedTextDataset, loss_mask_token
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.trainer import loss_tokens
from torchtitan.trainer.loss_tokens import TokenWeightedLoss

pytestmark = pytest.mark.fast

VOCAB, SEQ, DIM = 11, 6, 4


class _Mesh:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self):
        return "loss mesh"


class _Dims:
    def __init__(self, ranks: int):
        self.loss_mesh = _Mesh(ranks) if ranks > 1 else None


def _micro_batch(gen: torch.Generator, rows: int, masked: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, SEQ, DIM, generator=gen)
    y = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    y[torch.rand(rows, SEQ, generator=gen) < masked] = IGNORE_INDEX
    return x, y


def _rank_step(weight: torch.Tensor, micro_batches, loss_fn: TokenWeightedLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's step as forward_backward runs it: count, then each micro-batch's weighted loss."""
    loss_fn.start_step([y for _, y in micro_batches])
    total = sum(loss_fn(x @ weight, y) for x, y in micro_batches)
    (grad,) = torch.autograd.grad(total, weight)
    return total.detach(), grad


def test_uneven_masks_over_micro_batches_and_ranks_give_the_mean_over_every_valid_token(monkeypatch):
    """Two data-parallel ranks of two micro-batches each, masked unevenly (one rank's second
    micro-batch almost entirely): the ranks' mean loss and mean gradient (what the data-parallel
    reduction takes) are those of one process's mean over every valid token of the step."""
    gen = torch.Generator().manual_seed(0)
    ranks = [[_micro_batch(gen, 2, 0.2), _micro_batch(gen, 2, 0.5)], [_micro_batch(gen, 2, 0.1), _micro_batch(gen, 2, 0.8)]]
    weight = torch.randn(DIM, VOCAB, generator=gen, requires_grad=True)
    counts = [sum(int((y != IGNORE_INDEX).sum()) for _, y in rank) for rank in ranks]
    assert len(set(counts)) == 2  # the ranks hold different counts: the case the weighting is for

    losses, grads = [], []
    for r, rank in enumerate(ranks):
        other = counts[1 - r]

        def all_reduce(total, group, other=other):  # the other rank's count, as the loss mesh's all-reduce adds
            assert group == "loss mesh"
            total += other

        monkeypatch.setattr(loss_tokens.dist, "all_reduce", all_reduce)
        loss, grad = _rank_step(weight, rank, TokenWeightedLoss(cross_entropy_loss, _Dims(2)))
        losses.append(loss)
        grads.append(grad)

    x = torch.cat([x for rank in ranks for x, _ in rank])
    y = torch.cat([y for rank in ranks for _, y in rank])
    expected = F.cross_entropy((x @ weight).flatten(0, 1), y.flatten())
    (expected_grad,) = torch.autograd.grad(expected, weight)
    # The same sums split otherwise (per micro-batch and rank): over the 48 tokens, the vocabulary, DIM.
    assert_reordered(sum(losses) / 2, expected.detach(), 48 + VOCAB + DIM)
    assert_reordered(sum(grads) / 2, expected_grad, 48 + VOCAB + DIM)
    # The mean of per-micro-batch means (the normalisation before) is measurably different here.
    per_micro = [cross_entropy_loss(x @ weight, y) for rank in ranks for x, y in rank]
    assert abs(float(sum(per_micro) / 4 - expected)) > 1e-3


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_without_masked_labels_the_loss_is_bitwise_the_mean_over_accumulation(accum):
    gen = torch.Generator().manual_seed(accum)
    micro_batches = [_micro_batch(gen, 2, 0.0) for _ in range(accum)]
    weight = torch.randn(DIM, VOCAB, generator=gen, requires_grad=True)
    loss_fn = TokenWeightedLoss(cross_entropy_loss, None)
    loss_fn.start_step([y for _, y in micro_batches])
    for x, y in micro_batches:
        assert torch.equal(loss_fn(x @ weight, y), cross_entropy_loss(x @ weight, y) / accum)


def test_an_all_masked_micro_batch_adds_nothing_and_no_nan():
    gen = torch.Generator().manual_seed(1)
    kept, masked = _micro_batch(gen, 2, 0.3), _micro_batch(gen, 2, 0.0)
    masked[1].fill_(IGNORE_INDEX)
    weight = torch.randn(DIM, VOCAB, generator=gen, requires_grad=True)
    loss, grad = _rank_step(weight, [kept, masked], TokenWeightedLoss(cross_entropy_loss, None))
    alone, alone_grad = _rank_step(weight, [kept], TokenWeightedLoss(cross_entropy_loss, None))
    torch.testing.assert_close(loss, alone)
    torch.testing.assert_close(grad, alone_grad)
    # A whole step without a valid label: a zero loss and zero gradients, not 0 / 0.
    loss, grad = _rank_step(weight, [masked], TokenWeightedLoss(cross_entropy_loss, None))
    assert loss == 0 and torch.count_nonzero(grad) == 0


def test_summing_gives_the_sum_over_valid_tokens_and_a_step_must_be_counted_first():
    gen = torch.Generator().manual_seed(2)
    x, y = _micro_batch(gen, 3, 0.4)
    logits = x @ torch.randn(DIM, VOCAB, generator=gen)
    loss_fn = TokenWeightedLoss(cross_entropy_loss, None)
    with loss_fn.summing():
        summed = loss_fn(logits, y)
    torch.testing.assert_close(summed, F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
    with pytest.raises(RuntimeError, match="start_step"):
        loss_fn(logits, y)


def test_the_dataset_ignores_exactly_the_labels_after_each_end_of_text(tmp_path):
    class CharTokenizer:
        bos_id, eos_id, n_words = 1, 2, 256

        def encode(self, text, bos, eos):
            return [1] + [ord(c) for c in text] + [2]

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "cdefg", "h", "ijklmnopq", "rs"] * 4))
    plain = iter(PackedTextDataset(path, CharTokenizer(), 8, 2, [0], 1))
    masked = iter(PackedTextDataset(path, CharTokenizer(), 8, 2, [0], 1, ignore_after=2))
    for _ in range(3):
        (inputs, labels), (masked_inputs, masked_labels) = next(plain), next(masked)
        assert torch.equal(inputs, masked_inputs)
        after_eos = inputs == 2
        assert after_eos.any()
        assert torch.equal(masked_labels, torch.where(after_eos, IGNORE_INDEX, labels))
    assert loss_mask_token(parse_args([]), CharTokenizer()) is None
    assert loss_mask_token(parse_args(["--training.mask_loss_after_eos"]), CharTokenizer()) == 2


def test_a_tokenizer_without_end_of_text_is_refused_for_the_mask():
    class Vocabulary:
        eos_id = -1

    with pytest.raises(ConfigError, match="training.mask_loss_after_eos needs an end-of-text token .*leave "
                                          "training.mask_loss_after_eos off"):
        check_document_mask(parse_args(["--training.mask_loss_after_eos"]), Vocabulary())


def test_steps_where_no_label_carries_a_loss_are_warned_about_once_and_counted(caplog):
    """All-masked steps (every label IGNORE_INDEX: mask_loss_after_eos on end-of-text data) are counted on
    the device and read at the step lines: the first are warned about once, every one is counted."""
    loss_fn = TokenWeightedLoss(cross_entropy_loss, None)
    steps = loss_tokens.StepsWithoutLoss(loss_fn)
    masked, some = torch.full((2, SEQ), IGNORE_INDEX), torch.zeros(2, SEQ, dtype=torch.long)
    with caplog.at_level(logging.WARNING):
        loss_fn.start_step([some])
        steps.read(1, 1)  # a step line over a step with labels: nothing to say
        for labels in ([masked, masked], [masked, some], [masked]):  # steps 2-4: two without a loss
            loss_fn.start_step(labels)
        steps.read(2, 4)
        loss_fn.start_step([masked])
        steps.read(5, 5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["2 of the 3 steps 2-4 had no label that carries a loss, on any rank (every label masked: "
                        "training.mask_loss_after_eos masks the one after each end-of-text token): such a step's loss and "
                        "gradient norm are 0 and it trains nothing; check the data (said once; the run summary counts "
                        "every such step)"]
    assert steps.total == 3
    assert loss_tokens.StepsWithoutLoss(cross_entropy_loss).total == 0  # another loss function: nothing counted
