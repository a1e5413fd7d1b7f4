"""Tests for activation offload (torchtitan/parallelisms/activation_offload.py): exact against no
offload under every AC variant, saved tensors really copied out and released, parameters left
alone, checkpoint keys unchanged, one copy per saved tensor and version, and the dry run counting
the copies as host memory."""

import copy
import gc
import logging
import weakref

import pytest
import torch
import torch.nn.functional as F

from tests.unit_tests.test_dry_run import DEBUG
from torchtitan.config.manager import parse_args
from torchtitan.config.sections import check_activation_checkpoint
from torchtitan.errors import ConfigError
from torchtitan.estimation.dry_run import dry_run
from torchtitan.estimation.tracker import _host_devices
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.activation_offload import (
    ActivationOffloader,
    OffloadStats,
    OffloadWrapper,
    apply_offload,
    chosen_blocks,
)
from torchtitan.parallelisms.tensor_parallel import apply_ac_and_compile

ARGS = ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128)
SEQ_LEN = 64
MIN_BYTES = 1024  # the tiny model's activations are a few KiB to 256 KiB
AC_VARIANTS = {"none": None, "selective2": ("selective", "2"), "op": ("selective", "op"), "full": ("full", "")}


def base_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def batch(batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (batch_size, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, labels = batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss, {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


class Spy:
    """Wraps every offloader's pack to record what went in and what came out."""

    def __init__(self, model: Transformer):
        self.moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (saved tensor, its host copy)
        self.kept: list[torch.Tensor] = []
        for block in model.layers.values():
            block.offloader.pack = self._spying(block.offloader.pack)

    def _spying(self, pack):
        def spy(t):
            packed = pack(t)
            if packed is t:
                self.kept.append(t)
            else:
                self.moved.append((t, packed.packed.host))
            return packed
        return spy


@pytest.mark.parametrize("ac", AC_VARIANTS)
def test_offload_is_bitwise_exact_under_every_ac_variant(ac):
    base = base_model()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    if AC_VARIANTS[ac]:
        apply_ac(model, *AC_VARIANTS[ac])
    stats = apply_offload(model, "all", min_bytes=MIN_BYTES)
    loss, grads = loss_and_grads(model)
    assert stats.tensors > 0 and stats.bytes > 0
    assert stats.host_bytes == 0, "backward releases every host copy"
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def test_checkpointed_blocks_offload_only_their_input():
    """A block checkpointed in full saves its input through autograd (checkpoint's own saving
    node) and nothing else: that input is what moves, one (batch, seq, dim) tensor per block."""
    model = base_model()
    apply_ac(model, "full", "")
    stats = apply_offload(model, "all", min_bytes=MIN_BYTES)
    loss_and_grads(model)
    assert stats.tensors == ARGS.n_layers
    assert stats.bytes == ARGS.n_layers * 2 * SEQ_LEN * ARGS.dim * 4


def test_saved_tensors_leave_and_parameters_stay():
    model = base_model()
    apply_offload(model, "all", min_bytes=MIN_BYTES)
    spy = Spy(model)
    inputs, labels = batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    params = {p.untyped_storage() for p in model.parameters()}
    assert spy.moved and spy.kept
    for saved, host in spy.moved:
        # A distinct copy of the same values and layout, in memory of its own.
        assert host.untyped_storage() is not saved.untyped_storage() and host.data_ptr() != saved.data_ptr()
        assert torch.equal(host, saved) and host.stride() == saved.stride()
        assert saved.untyped_storage() not in params
    # Parameters (as they are, and their transposes saved by the matmuls) were kept, none moved.
    assert any(t.untyped_storage() in params for t in spy.kept)
    # The originals are freed once the forward's references are gone: only the copies hold them.
    originals = [weakref.ref(saved.untyped_storage()) for saved, _ in spy.moved]
    del saved, host
    spy.moved.clear()
    gc.collect()
    assert all(ref() is None for ref in originals)
    loss.backward()


def test_one_copy_per_saved_tensor_unless_written_in_between():
    offloader = ActivationOffloader(OffloadStats(), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with offloader.hooks(torch.nn.Linear(1, 1)):
        y = x * 2
        first, again = offloader.pack(y), offloader.pack(y)
        before = y.detach().clone()
        y.mul_(3)
        after_write = offloader.pack(y)
    assert first is again and after_write is not first
    assert torch.equal(offloader.unpack(after_write), y) and torch.equal(offloader.unpack(first), before)
    assert offloader.stats.tensors == 2


def test_small_tensors_and_constant_inputs_stay():
    offloader = ActivationOffloader(OffloadStats())  # the default threshold
    table = torch.randn(256, 256)  # a block input that needs no gradient, like the RoPE table
    with offloader.hooks(torch.nn.Linear(1, 1), (table,)):
        small, large = torch.randn(8, requires_grad=True) * 2, torch.randn(256, 256, requires_grad=True) * 2
        assert offloader.pack(small) is small and offloader.pack(table) is table
        assert offloader.pack(large) is not large
        assert offloader.pack(large.t()) is not large  # transposed: still dense, moved
        half = large[:, :128]  # every other half row: not dense, a copy would not free its memory
        assert offloader.pack(half) is half
    assert offloader.stats.kept == 3 and offloader.stats.tensors == 2


def test_state_dict_keys_and_loading_are_those_of_the_bare_model():
    bare = base_model()
    for ac in AC_VARIANTS.values():
        model = copy.deepcopy(bare)
        if ac:
            apply_ac(model, *ac)
        apply_offload(model, "all")
        assert list(model.state_dict()) == list(bare.state_dict())
        model.load_state_dict(bare.state_dict())  # strict: every key found under the wrappers


def test_every_kth_block_is_offloaded_and_logged(caplog):
    assert chosen_blocks([str(i) for i in range(6)], "2") == ["0", "2", "4"]
    assert chosen_blocks(["0", "1"], "all") == ["0", "1"] and chosen_blocks(["0", "1"], "none") == []
    model = base_model()
    with caplog.at_level(logging.INFO):
        apply_ac_and_compile(model, False, "selective", "2", False, offload="3")
    wrapped = [name for name, block in model.layers.items() if isinstance(block, OffloadWrapper)]
    assert wrapped == ["0", "3"]
    assert "applied activation offload to 2 of 4 blocks" in caplog.text


def test_the_dry_run_counts_offloaded_activations_as_host_memory():
    """Standing for a GPU, the copies go to the host: the device's activations drop by about what
    the host then holds."""
    args = [*DEBUG, "--job.dry_run_world_size", "2", "--job.dry_run_device", "cuda", "--activation_checkpoint.mode", "none"]
    off = dry_run(parse_args(args)).ranks[0].memory
    on = dry_run(parse_args([*args, "--activation_checkpoint.offload", "all"])).ranks[0].memory
    assert off.host == 0 and on.host > 0
    assert on.at_peak["activations"] < 0.5 * off.at_peak["activations"]
    assert on.peak < off.peak
    moved = off.at_peak["activations"] - on.at_peak["activations"]
    assert 0.8 * moved < on.host < 1.5 * moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory, side-stream path needs CUDA")
def test_cuda_offload_is_exact_and_pinned():
    base = base_model().cuda()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    stats = apply_offload(model, "all", min_bytes=MIN_BYTES)
    spy = Spy(model)
    loss, grads = loss_and_grads(model)
    assert stats.tensors > 0 and all(host.is_pinned() and host.device.type == "cpu" for _, host in spy.moved)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def test_the_tracker_reads_host_memory_by_device():
    """Offloaded copies are host memory: the CPU's beside a GPU, the meta device's in a dry run
    (whose CPU stands for the GPU); on a CPU-only run host and device are one memory."""
    cpu, gpu, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    assert _host_devices({gpu: {}, cpu: {}}) == {cpu}
    assert _host_devices({cpu: {}, meta: {}}) == {meta}
    assert _host_devices({cpu: {}}) == set()


@pytest.mark.parametrize("value", ["0", "some", "-1"])
def test_a_bad_offload_value_is_one_line(value):
    with pytest.raises(ConfigError, match=f"activation_checkpoint.offload must be 'none', 'all' or a positive integer k .*'{value}'"):
        check_activation_checkpoint(parse_args(["--activation_checkpoint.offload", value]))
