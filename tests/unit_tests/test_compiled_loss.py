"""training.compile compiles the loss too on CUDA (step.with_compiled_loss), except under loss
parallelism: the same values and gradients as the eager loss, in fp32 and from bf16 logits (the
compiled function is run here on CPU tensors: the code inductor generates for CPU)."""

import pytest
import torch

from tests.tolerances import reordered_sums, then_rounded_to
from torchtitan.config.manager import parse_args
from torchtitan.models.train_spec import get_train_spec
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.trainer.step import with_compiled_loss


def dims(tp=1):
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, world_size=tp, enable_loss_parallel=True)


def test_only_compiled_cuda_runs_without_loss_parallelism_compile_the_loss():
    spec = get_train_spec("llama3")
    compiled = parse_args(["--training.compile"])
    assert with_compiled_loss(spec, parse_args([]), dims(), "cuda") is spec
    assert with_compiled_loss(spec, compiled, dims(tp=2), "cuda") is spec  # DTensor's loss_parallel computes it
    assert with_compiled_loss(spec, compiled, dims(), "cpu") is spec  # not worth its compile time there
    assert with_compiled_loss(spec, compiled, dims(), "cuda").loss_fn is not spec.loss_fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_equals_the_eager_loss(dtype):
    spec = get_train_spec("llama3")
    loss_fn = with_compiled_loss(spec, parse_args(["--training.compile"]), dims(), "cuda").loss_fn
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, 96, generator=g).to(dtype)
    labels = torch.randint(0, 96, (2, 16), generator=g)
    results = []
    for fn in (spec.loss_fn, loss_fn):
        x = logits.clone().requires_grad_()
        loss = fn(x, labels)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert compiled.dtype == torch.float32
    # Inductor's generated loops order the sums otherwise (the log-sum-exp over the 96 logits, the
    # mean over the 32 tokens), in fp32 for either dtype; a bf16 gradient is then rounded to bf16.
    torch.testing.assert_close(compiled, eager, **reordered_sums(torch.float32, 96 + 32, eager.item()))
    grad_tolerance = reordered_sums(torch.float32, 96 + 32, float(eager_grad.abs().max()))
    if dtype == torch.bfloat16:
        grad_tolerance = then_rounded_to(torch.bfloat16, grad_tolerance, float(eager_grad.abs().max()))
    torch.testing.assert_close(compiled_grad, eager_grad, **grad_tolerance)
