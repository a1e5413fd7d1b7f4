"""Mixed precision without FSDP (parallelisms/mixed_precision.py), in one process: what autocast
computes in bf16, what stays fp32, and which layouts leave the casting to FSDP. The multi-rank
comparisons (bf16 layouts against one bf16 process, bf16 against fp32 over 30 steps) are in
tests/integration (test_parity.py's bf16 suite, test_mixed_precision.py)."""

import pytest
import torch

from tests.tolerances import rounded_ops
from tests.unit_tests.test_llama_model import build_tiny
from torchtitan.config.manager import parse_args
from torchtitan.models.common import causal_attention
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.moe import GroupedExperts
from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.mixed_precision import apply_mixed_precision, autocast_dtype, compute_dtype, uses_autocast
from torchtitan.parallelisms.parallel_dims import ParallelDims


def dims(dp_shard=1, dp_replicate=1, world_size=1):
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=1, pp=1, world_size=world_size,
                        enable_loss_parallel=True)


def training(dtype: str):
    return parse_args(["--training.mixed_precision_param", dtype]).training


def tokens(batch=2, seq=16, vocab=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu_for_every_layout():
    t = training("auto")
    assert compute_dtype(t, "cuda") == torch.bfloat16 and compute_dtype(t, "cpu") == torch.float32
    assert uses_autocast(t, dims(), "cuda") and uses_autocast(t, dims(dp_replicate=2, world_size=2), "cuda")
    assert not uses_autocast(t, dims(dp_shard=2, world_size=2), "cuda")  # FSDP's policy casts instead
    assert not uses_autocast(t, dims(), "cpu")


def test_bf16_forward_keeps_fp32_weights_gradients_and_loss():
    model = build_tiny()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_mixed_precision([model], dims(), training("bfloat16"), "cpu")
    assert autocast_dtype(model) == torch.bfloat16
    inputs, labels = tokens()
    logits = model(inputs)
    assert logits.dtype == torch.bfloat16  # the output projection ran in bf16
    loss = cross_entropy_loss(logits, labels)
    assert loss.dtype == torch.float32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.detach(), weights[name]), name  # master weights untouched by the casts


def test_bf16_matches_fp32_to_bf16_precision_and_differs_from_it():
    """The same model and batch: bf16 autocast is close to fp32 (not equal: it really runs bf16)."""
    fp32, bf16 = build_tiny(), build_tiny()
    apply_mixed_precision([bf16], dims(), training("bfloat16"), "cpu")
    inputs, labels = tokens()
    a, b = cross_entropy_loss(fp32(inputs), labels), cross_entropy_loss(bf16(inputs), labels)
    assert 0 < abs(a.item() - b.item()) < 2e-2 * a.item()


def test_float32_and_fsdp_layouts_are_left_alone():
    model = build_tiny()
    forward = model.forward
    apply_mixed_precision([model], dims(), training("float32"), "cpu")
    apply_mixed_precision([model], dims(dp_shard=2, world_size=2), training("bfloat16"), "cpu")
    assert model.forward == forward and autocast_dtype(model) is None


def test_activation_checkpointing_recomputes_in_bf16():
    """Recomputation in backward restores the forward's autocast state: gradients equal those of
    the same bf16 model without checkpointing."""
    plain, checkpointed = build_tiny(), build_tiny()
    apply_ac(checkpointed, "full", "2")
    inputs, labels = tokens()
    grads = []
    for model in (plain, checkpointed):
        apply_mixed_precision([model], dims(), training("bfloat16"), "cpu")
        cross_entropy_loss(model(inputs), labels).backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


def test_cpu_attention_stays_fp32_under_autocast():
    """CPU attention upcasts bf16 inputs to fp32 (faster backward); autocast must not cast them back."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g).bfloat16() for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)


def test_grouped_experts_compute_in_the_autocast_dtype():
    """torch._grouped_mm has no autocast rule: the experts cast their operands themselves."""
    torch.manual_seed(0)
    experts = GroupedExperts(16, 32, 4)
    experts.init_weights(0.02)
    x, counts = torch.randn(12, 16), torch.tensor([3, 0, 5, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
    assert out.dtype == torch.bfloat16
    # bf16 against fp32: the inputs and weights rounded to bf16, then each of the three matmuls' outputs
    # (accumulated in fp32): about 6 bf16 roundings, at the outputs' own scale.
    expected = experts(x, counts)
    torch.testing.assert_close(out.float(), expected, **rounded_ops(torch.bfloat16, 6, float(expected.abs().max())))


@pytest.mark.parametrize("error", [AttributeError, RuntimeError])
def test_a_pytorch_that_cannot_say_counts_as_a_cpu_without_bf16(monkeypatch, error):
    """oneDNN's query is private: a PyTorch without it (AttributeError) or built without oneDNN
    (RuntimeError) gets the warning rather than a crash."""
    from torchtitan.parallelisms import mixed_precision

    def cannot_say():
        raise error("no oneDNN here")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", cannot_say)
    assert mixed_precision.cpu_has_bf16_matmul.__wrapped__() is False  # past functools.cache's answer


def test_bf16_on_a_cpu_without_bf16_instructions_warns_once(monkeypatch, caplog):
    """Said by the preflight for the device the job runs on: a dry run standing for GPUs is quiet."""
    from torchtitan.parallelisms import mixed_precision

    monkeypatch.setattr(mixed_precision, "cpu_has_bf16_matmul", lambda: False)
    mixed_precision.warn_if_emulated(training("bfloat16"), "cuda")
    mixed_precision.warn_if_emulated(training("float32"), "cpu")
    assert not caplog.records
    mixed_precision.warn_if_emulated(training("bfloat16"), "cpu")
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "emulated" in caplog.text
