"""Tests for activation checkpointing: activation memory kept for backward, gradients against no AC,
and what op-level selective AC saves versus recomputes."""

import copy
import gc
import logging
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.parallelisms.activation_checkpoint import _SAVE_LIST, apply_ac

ARGS = ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128)
MATMULS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w3, w2
SEQ_LEN = 64
# name -> (mode, selective_ac_option) given to apply_ac; None leaves the model alone.
VARIANTS = {"none": None, "selective2": ("selective", "2"), "op": ("selective", "op"), "full": ("full", "")}


def build_variants() -> dict[str, Transformer]:
    torch.manual_seed(0)
    base = Transformer(ARGS)
    base.init_weights()
    models = {}
    for name, ac in VARIANTS.items():
        models[name] = copy.deepcopy(base)  # before AC, so every variant starts from the same weights
        if ac is not None:
            apply_ac(models[name], *ac)
    return models


def batch(batch_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (batch_size, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())


class _StorageRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out


def live_storages(recorder: _StorageRecorder, exclude: set[int]) -> dict[int, int]:
    gc.collect()  # reference cycles must not count as kept for backward
    live = {}
    for ref in recorder.storages:
        storage = ref()
        if storage is not None and storage.data_ptr() not in exclude:
            live[storage.data_ptr()] = storage.nbytes()
    return live


def activation_bytes(model: Transformer, batch_size: int) -> tuple[int, dict[int, int]]:
    """Bytes of storage allocated by the forward pass (inputs -> loss) that are still alive once it
    returns, i.e. what autograd and checkpointing keep for backward. Also returns what is still
    alive after backward, which should be nothing.

    Exact, and not an estimate from shapes: every tensor an op returns is recorded below autograd,
    so the outputs of every kernel are seen, including SAC's cached copies and the tensors that
    checkpoint recomputes later. What is tracked is the storage, not the tensor: autograd saves a
    node's own outputs as fresh tensors over the same storage (SavedVariable keeps
    `tensor_data()` to avoid a reference cycle), so a weakref to the tensor would die while its
    memory is still held. A storage's Python object, in contrast, is kept alive by PyTorch for as
    long as the C++ storage lives, so its weakref dies exactly when the memory is released.
    Counting by storage also counts views once. Parameters, buffers and the inputs are excluded:
    views of them (weight transposes, the RoPE slice) come out of ops but allocate nothing.
    """
    inputs, labels = batch(batch_size)
    preexisting = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), inputs, labels)}
    with _StorageRecorder() as recorder:
        loss = loss_of(model, inputs, labels)
    kept = sum(live_storages(recorder, preexisting).values())
    loss.backward()
    del loss
    return kept, live_storages(recorder, preexisting)


@pytest.fixture
def fast_gc():
    # Hides every object alive now from the collector, so each gc.collect() in the measurement
    # scans only what the test creates: a full collection after importing torch takes ~0.3 s.
    gc.freeze()
    yield
    gc.unfreeze()


def test_activation_memory_ordering(fast_gc):
    models = build_variants()
    kept = {}
    for name, model in models.items():
        kept[name], after_backward = activation_bytes(model, batch_size=2)
        assert after_backward == {}, f"{name}: backward should release everything the forward kept"
    print("\nactivation bytes kept for backward (batch 2, seq 64): "
          + ", ".join(f"{name} {b:,}" for name, b in kept.items()))
    assert kept["none"] > kept["selective2"] > kept["full"]
    assert kept["none"] > kept["op"] > kept["full"]
    # The measurement scales with the activations it claims to measure.
    assert activation_bytes(models["none"], batch_size=4)[0] > 1.9 * kept["none"]
    assert activation_bytes(models["full"], batch_size=4)[0] > 1.9 * kept["full"]


def test_gradients_match_no_ac():
    models = build_variants()
    inputs, labels = batch(2)
    grads, losses = {}, {}
    for name, model in models.items():
        losses[name] = loss_of(model, inputs, labels)
        losses[name].backward()
        # Wrapping inserts `_checkpoint_wrapped_module.` into names; strip it to compare across variants.
        grads[name] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    for name in VARIANTS:
        # Recompute runs the same kernels on the same inputs, so on CPU in fp32 the match is bitwise.
        torch.testing.assert_close(losses[name], losses["none"], rtol=0, atol=0)
        assert grads[name].keys() == grads["none"].keys()
        for param_name, grad in grads[name].items():
            torch.testing.assert_close(grad, grads["none"][param_name], rtol=0, atol=0, msg=f"{name}: {param_name}")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(model: Transformer) -> Counter:
    loss = loss_of(model, *batch(2))
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_op_level_policy_saves_matmuls_and_attention_and_recomputes_the_rest():
    models = build_variants()
    baseline = backward_ops(models["none"])
    # Forward ops that backward runs on top of no AC's backward are the recomputed ones.
    recomputed = {name: backward_ops(models[name]) - baseline for name in ("op", "full")}
    n = ARGS.n_layers
    silu, mm = torch.ops.aten.silu.default, torch.ops.aten.mm.default
    # Recompute stops at the last op whose output backward needs, so each block's w2 is not rerun.
    assert recomputed["full"][mm] == (MATMULS_PER_BLOCK - 1) * n
    assert sum(c for op, c in recomputed["full"].items() if op in _SAVE_LIST and op is not mm) == n  # attention
    assert recomputed["full"][silu] == n
    assert not [op for op in recomputed["op"] if op in _SAVE_LIST], recomputed["op"]
    assert recomputed["op"][silu] == n


def test_op_level_wraps_every_block_and_logs(caplog):
    with caplog.at_level(logging.INFO):
        model = build_variants()["op"]
    assert all(isinstance(block, CheckpointWrapper) for block in model.layers.values())
    assert "applied selective (op-level) activation checkpointing to 4 of 4 blocks" in caplog.text
