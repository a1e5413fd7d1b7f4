"""The Validator in one process, without a process group: a stand-in model records what it is
given, so what validation asks of the model (rows per forward, eval mode, no gradients, its mean)
is checked directly."""

import contextlib
import math
import types

import pytest
import torch

from tests.tolerances import reordered_sums
from torchtitan.config.manager import parse_args
from torchtitan.datasets.sources import DatasetError
from torchtitan.datasets.text_dataset import validation_batch_size
from torchtitan.trainer.validation import ValidatedModel, Validator

SEQ, VOCAB = 8, 16
NO_MESHES = types.SimpleNamespace(cp_mesh=None, loss_mesh=None, pp_mesh=None)
# fp32 against the exact mean: a log-sum-exp over VOCAB, a mean over a part's 2 x SEQ tokens, and over
# the (at most 6) parts.
REL = reordered_sums(torch.float32, VOCAB + 2 * SEQ + 6)["rtol"]


class Recorder(torch.nn.Module):
    """Logits that favour token 0 by `bias`; records each forward's rows, mode and grad mode."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(2.0))
        self.calls = []

    def forward(self, inputs):
        self.calls.append((inputs.shape[0], self.training, torch.is_grad_enabled()))
        logits = torch.zeros(*inputs.shape, VOCAB)
        logits[..., 0] = self.bias
        return logits


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def validator(args, batches, model):
    job_config = parse_args(["--training.seq_len", str(SEQ), "--validation.enabled", *args])
    rows = validation_batch_size(job_config)

    def build(job_config, tokenizer, shards):
        return [(torch.full((rows, SEQ), 1), torch.full((rows, SEQ), label)) for label in batches]

    validated = ValidatedModel(NO_MESHES, [model], None, torch.device("cpu"), loss_fn, contextlib.nullcontext)
    return Validator(job_config, build, None, validated, types.SimpleNamespace(dp_degree=1))


def test_a_validation_batch_goes_through_in_parts_of_the_training_batch():
    """The default validation batch holds every micro-batch of an optimizer step (2 x 3 rows); the
    model sees 2 rows at a time, in eval mode without gradients, and the loss is the mean over all."""
    model = Recorder()
    v = validator(["--training.batch_size", "2", "--training.gradient_accumulation_steps", "3",
                   "--validation.steps", "-1"], [0, 1], model)
    result = v.run(step=5)
    assert model.calls == [(2, False, False)] * 6 and model.training
    p0 = torch.softmax(torch.tensor([2.0] + [0.0] * (VOCAB - 1)), 0)  # label 0 in one batch, 1 in the other
    expected = (-math.log(p0[0]) - math.log(p0[1])) / 2
    assert result.step == 5 and result.batches == 2 and result.tokens == 2 * 6 * SEQ
    assert result.loss == pytest.approx(expected, rel=REL)


def test_a_part_smaller_than_the_others_weighs_by_its_rows():
    model = Recorder()
    v = validator(["--training.batch_size", "4", "--validation.batch_size", "5", "--validation.steps", "1"], [0], model)
    loss = v.run(step=1).loss
    assert [c[0] for c in model.calls] == [4, 1]
    p0 = torch.softmax(torch.tensor([2.0] + [0.0] * (VOCAB - 1)), 0)
    assert loss == pytest.approx(-math.log(p0[0]), rel=REL)


def test_a_stop_requested_meanwhile_abandons_the_run():
    model = Recorder()
    v = validator(["--validation.steps", "-1"], [0, 0, 0], model)
    assert v.run(step=3, stops=types.SimpleNamespace(requested=15)) is None
    assert model.training  # the model is given back in training mode


def test_validation_data_without_a_batch_is_refused_when_the_validator_is_built():
    with pytest.raises(DatasetError, match="validation: the validation data gives no full batch of 8 x 8 tokens"):
        validator([], [], Recorder())


def test_validation_data_that_shrank_after_start_up_is_one_line():
    """The first batch was there when the validator was built; at a validation the data gives none
    (the file was replaced meanwhile): the same line as at start-up, and the model back in training."""
    model = Recorder()
    v = validator(["--validation.steps", "-1"], [0], model)
    v.build_dataloader = lambda job_config, tokenizer, shards: []
    with pytest.raises(DatasetError) as e:
        v.run(step=4)
    assert str(e.value) == ("validation: the validation data gives no full batch of 8 x 8 tokens per data-parallel rank; "
                            "give more validation data or lower validation.batch_size")
    assert model.training and model.calls == []
