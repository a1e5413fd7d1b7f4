"""`training.compile` takes every transformer block whole, in one graph (fullgraph: a graph break
fails), for every family: Llama 3, Qwen3 dense and MoE, DeepSeek-V3 (dense, MoE and MTP blocks), gpt-oss
(sinks, a banded and a full block, biased clamped experts), in
the dropping and the dropless MoE modes; each family through its own compile function, one forward
and backward on CPU, losses and gradients equal to eager. Which layouts keep the MoE layer eager is
`moe_compiles_whole`'s rule, tested last, and under EP the dropping mode's parts that compile on their
own (`compile_moe_parts`), against eager on a one-rank process group.

The family sweep compiles with the aot_eager backend (dynamo and AOTAutograd, the stages where graph
breaks and data-dependent shapes fail; no code generation, so a few seconds per family). Inductor's
generated code is the layout matrix's compiled points' (tests/integration/test_layout_matrix.py)."""

import copy
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.tolerances import assert_reordered, transformer_sums
from torchtitan.models.deepseek_v3 import DeepSeekV3, DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.parallelize_deepseek_v3 import apply_compile as compile_deepseek_v3
from torchtitan.models.deepseek_v3.parallelize_deepseek_v3 import mtp_block_slots
from torchtitan.models.gpt_oss import GptOss, GptOssModelArgs
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3 import Qwen3, Qwen3ModelArgs
from torchtitan.models.qwen3.parallelize_qwen3 import apply_compile as compile_qwen3
from torchtitan.models.qwen3.parallelize_qwen3 import apply_compile_attention as compile_qwen3_under_ep
from torchtitan.parallelisms.activation_checkpoint import apply_ac
from torchtitan.parallelisms.expert_parallel import apply_expert_parallel, compile_moe_parts, moe_compiles_whole
from torchtitan.parallelisms.tensor_parallel import apply_compile as compile_llama
from torchtitan.runtime.torch_compat.composable import bare_name

VOCAB, SEQ = 64, 16
QWEN3 = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=VOCAB,
             max_seq_len=SEQ)
QWEN3_MOE = dict(QWEN3, num_experts=4, top_k=2, moe_hidden_dim=32)
# 1 dense + 1 MoE block with a shared expert and group-limited sigmoid routing, and an MTP block.
DEEPSEEK_V3 = dict(dim=32, n_layers=2, n_dense_layers=1, n_heads=4, hidden_dim=48, vocab_size=VOCAB, max_seq_len=SEQ,
                   q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                   num_experts=8, n_shared_experts=1, top_k=2, moe_hidden_dim=16, score_func="sigmoid", n_group=4,
                   topk_group=2, route_scale=2.5, mtp_depth=1)
# A banded block (window 5, shorter than the sequence) and a full one, sinks, biased experts.
GPT_OSS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=VOCAB, max_seq_len=SEQ,
               sliding_window=5, num_experts=4, top_k=2, moe_hidden_dim=16)
LLAMA3 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, multiple_of=16)
# The sums of a forward of the largest family here (Llama's feed-forward hidden size 176, the MTP block
# a third), which the traced graph's decompositions may order otherwise; a backward runs them again
# and sums each weight's gradient over the 32 tokens.
FORWARD_SUMS = transformer_sums(n_layers=3, dim=64, hidden=176, seq=SEQ, head_dim=16)


def build(model_cls, args, capacity_factor=None):
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for module in model.modules():
        if capacity_factor is not None and hasattr(module, "capacity_factor"):
            module.capacity_factor = capacity_factor
    return model


FAMILIES = {
    "llama3": (lambda: build(Transformer, ModelArgs(**LLAMA3)), compile_llama),
    "qwen3": (lambda: build(Qwen3, Qwen3ModelArgs(**QWEN3)), compile_qwen3),
    "qwen3_moe_capacity": (lambda: build(Qwen3, Qwen3ModelArgs(**QWEN3_MOE), 1.0), compile_qwen3),
    "qwen3_moe_dropless": (lambda: build(Qwen3, Qwen3ModelArgs(**QWEN3_MOE), 0.0), compile_qwen3),
    "deepseek_v3_capacity": (lambda: build(DeepSeekV3, DeepSeekV3ModelArgs(**DEEPSEEK_V3), 1.0), compile_deepseek_v3),
    "deepseek_v3_dropless": (lambda: build(DeepSeekV3, DeepSeekV3ModelArgs(**DEEPSEEK_V3), 0.0), compile_deepseek_v3),
    # gpt-oss's parallelize compiles blocks with the shared apply_compile (Llama's).
    "gpt_oss_capacity": (lambda: build(GptOss, GptOssModelArgs(**GPT_OSS), 1.0), compile_llama),
    "gpt_oss_dropless": (lambda: build(GptOss, GptOssModelArgs(**GPT_OSS), 0.0), compile_llama),
    # Full AC first, as parallelize_deepseek_v3 applies it: the MTP block's checkpoint compiles with it.
    "deepseek_v3_checkpointed": (lambda: build(DeepSeekV3, DeepSeekV3ModelArgs(**DEEPSEEK_V3), 1.0),
                                 lambda m: (apply_ac(m, "full", "", mtp_block_slots(m)), compile_deepseek_v3(m))),
}


def loss_and_grads(model, tokens, labels):
    logits = model(tokens, labels=labels) if isinstance(model, DeepSeekV3) else model(tokens)
    loss = cross_entropy_loss(logits, labels)
    loss.backward()
    return loss.detach(), {bare_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}


def compile_with_backend(monkeypatch, backend):
    """Every `Module.compile` the family's function calls uses `backend` (its fullgraph kept)."""
    original = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **kw: original(self, *a, backend=backend, **kw))


def compare_compiled_to_eager(monkeypatch, family, backend):
    make, compile_family = FAMILIES[family]
    eager = make()
    compiled = copy.deepcopy(eager)
    compile_with_backend(monkeypatch, backend)
    compile_family(compiled)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    labels = torch.randint(0, VOCAB, (2, SEQ))
    torch._dynamo.reset()
    results = [loss_and_grads(m, tokens, labels) for m in (eager, compiled)]
    blocks = [*compiled.layers.values(), *(m.block for m in (getattr(compiled, "mtp", None) or ()))]
    assert all(b._compiled_call_impl is not None for b in blocks)  # whole blocks, none by parts
    return eager, compiled, results


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_block_compiles_in_one_graph_and_trains_as_eager(monkeypatch, family):
    eager, compiled, ((loss, grads), (compiled_loss, compiled_grads)) = compare_compiled_to_eager(
        monkeypatch, family, "aot_eager")
    # aot_eager runs the traced ops eagerly: the same kernels, so only decompositions may differ.
    assert_reordered(compiled_loss, loss, FORWARD_SUMS + VOCAB + 2 * SEQ)
    assert compiled_grads.keys() == grads.keys()
    for name in grads:
        assert_reordered(compiled_grads[name], grads[name], 2 * FORWARD_SUMS + 2 * SEQ, msg=name)
    moe = [[m for m in model.modules() if hasattr(m, "take_step_stats")] for model in (compiled, eager)]
    for mine, theirs in zip(*moe):  # routing statistics counted as eager (once, under a checkpoint too)
        assert all(torch.equal(a, b) for a, b in zip(mine.take_step_stats(), theirs.take_step_stats()))


def test_a_graph_break_fails_the_compile(monkeypatch):
    """The sweep's guarantee: a block whose experts run outside the graph (as they did before
    every block compiled whole, under `torch.compiler.disable`) does not compile in full graph."""
    make, compile_family = FAMILIES["qwen3_moe_dropless"]
    model = make()
    compile_with_backend(monkeypatch, "eager")
    compile_family(model)
    for block in model.layers.values():
        forward = block.moe.experts.forward
        block.moe.experts.forward = torch.compiler.disable(forward)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        model(torch.randint(0, VOCAB, (2, SEQ)))


def _dims(tp=1, ep=1):
    return types.SimpleNamespace(tp_enabled=tp > 1, ep=ep)


def test_which_layouts_compile_the_moe_layer_whole():
    assert moe_compiles_whole(_dims())  # both modes: test_every_block_compiles_in_one_graph_and_trains_as_eager
    assert not moe_compiles_whole(_dims(ep=2))  # the experts are an FSDP unit inside the block
    assert not moe_compiles_whole(_dims(tp=2))  # so is the layer, and a checkpoint wraps the compiled block


@pytest.fixture
def expert_mesh():
    """A one-rank gloo group and the experts' 2-D mesh (efsdp, ep) over it: expert parallelism's
    dispatch and the experts' own FSDP unit run as on every rank, their all-to-alls sending to this one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("efsdp", "ep"))
    finally:
        dist.destroy_process_group()


EP_COMPILE = {"qwen3_moe": (lambda: build(Qwen3, Qwen3ModelArgs(**QWEN3_MOE), 1.0), compile_qwen3_under_ep),
              # gpt-oss's parallelize compiles its blocks under EP as Qwen3's does (its experts' biases too).
              "gpt_oss": (lambda: build(GptOss, GptOssModelArgs(**GPT_OSS), 1.0), compile_qwen3_under_ep),
              "deepseek_v3": (lambda: build(DeepSeekV3, DeepSeekV3ModelArgs(**DEEPSEEK_V3), 1.0),
                              lambda m, dims: compile_deepseek_v3(m, moe_whole=False, parallel_dims=dims))}


@pytest.mark.parametrize("family", sorted(EP_COMPILE))
def test_the_dropping_mode_under_ep_compiles_its_moe_parts_and_trains_as_eager(monkeypatch, expert_mesh, family):
    """Under EP the experts are an FSDP unit of their own, which a block's graph cannot hold; in the
    dropping mode every shape is fixed by the batch and the capacity, so the router, the placement,
    the experts (expert parallelism's all-to-alls of equal splits inside, FSDP's hooks outside, as
    a block's) and the read-back each compile in one graph (fullgraph: a break fails), the layer's
    forward around them eager. The loss and every gradient equal the eager layout's, the routing
    statistics too; dropless compiles none of it (its dispatch reads counts to the host)."""
    make, compile_family = EP_COMPILE[family]
    eager = make()
    compiled = copy.deepcopy(eager)
    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **kw: original(fn, *a, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    for model in (eager, compiled):
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        apply_expert_parallel(layers, expert_mesh["ep"])
        if model is compiled:
            compile_family(model, _dims(ep=2))  # the layout EP 2 would be: its rule, not this mesh's size
        for layer in layers:
            fully_shard(layer.experts, mesh=expert_mesh["efsdp"])  # as apply_data_parallel's units
    layers = [m for m in compiled.modules() if isinstance(m, MoE)]
    assert layers and all(m.router._compiled_call_impl is not None and m.experts._compiled_call_impl is not None
                          and {"capacity_place", "capacity_combine"} <= vars(m).keys() for m in layers)
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    (loss, grads), (compiled_loss, compiled_grads) = (loss_and_grads(m, tokens, labels) for m in (eager, compiled))
    # aot_eager runs the traced ops eagerly: the same kernels, so only decompositions may differ.
    assert_reordered(compiled_loss, loss, FORWARD_SUMS + VOCAB + 2 * SEQ)
    assert compiled_grads.keys() == grads.keys()
    for name in grads:
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in (compiled_grads[name], grads[name])]
        assert_reordered(*full, 2 * FORWARD_SUMS + 2 * SEQ, msg=name)
    for mine, theirs in zip(compiled.modules(), eager.modules()):
        if isinstance(mine, MoE):
            assert all(torch.equal(a, b) for a, b in zip(mine.take_step_stats(), theirs.take_step_stats()))
    dropless = make().layers[str(len(eager.layers) - 1)].moe
    dropless.capacity_factor = 0.0
    assert not compile_moe_parts(dropless, _dims(ep=2)) and not compile_moe_parts(layers[0], _dims(ep=2, tp=2))
