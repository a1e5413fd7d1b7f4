"""The tensor-parallel plans both model families apply, module by module: the shared decoder plan
(parallelisms/decoder_tp_plan.py) must give exactly the plans each family wrote out for itself
before it was shared. The expected plans below are those, written out in full; the families'
apply_tp runs on meta-device models with `parallelize_module` recorded instead of applied."""

import importlib
import itertools

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.model import Qwen3
from torchtitan.parallelisms.expert_parallel import moe_tp_plan

decoder_tp_plan = importlib.import_module("torchtitan.parallelisms.decoder_tp_plan")
tensor_parallel = importlib.import_module("torchtitan.parallelisms.tensor_parallel")
# The packages re-export the parallelize functions under the modules' names, so import the modules.
parallelize_llama = importlib.import_module("torchtitan.models.llama.parallelize_llama")
parallelize_qwen3 = importlib.import_module("torchtitan.models.qwen3.parallelize_qwen3")


class FakeMesh:
    def size(self) -> int:
        return 2


def describe(plan: dict) -> dict:
    """Each module's style as (class, its settings): two styles compare equal when they would shard alike."""
    return {name: (type(style).__qualname__, type(style).__module__, {k: repr(v) for k, v in vars(style).items()})
            for name, style in plan.items()}


def recorded_plans(monkeypatch, apply_tp, model, **kwargs) -> list[tuple[str, dict]]:
    """(module class, described plan) of every parallelize_module call apply_tp makes."""
    calls = []

    def record(module, mesh, plan):
        calls.append((type(module).__name__, describe(plan)))
        return module

    for module in (decoder_tp_plan, tensor_parallel):
        monkeypatch.setattr(module, "parallelize_module", record)
    apply_tp(model, FakeMesh(), **kwargs)
    return calls


def build(model_cls, args):
    import torch

    with torch.device("meta"):
        return model_cls.from_model_args(args)


def root_plan(sp: bool, lp: bool) -> dict:
    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(),
                                  use_local_output=not lp),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


def llama_block_plan(sp: bool, styles=(ColwiseParallel, RowwiseParallel, PrepareModuleInput)) -> dict:
    """Llama's block plan as parallelize_llama wrote it before the plan was shared."""
    colwise, rowwise, prepare_input = styles
    seq = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=seq),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=seq),
    }
    if sp:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def qwen3_block_plan(sp: bool, moe: bool) -> dict:
    """Qwen3's block plan as parallelize_qwen3 wrote it before the plan was shared."""
    seq = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    if moe:
        plan["moe"] = moe_tp_plan(sp)
    else:
        plan.update({
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })
    if sp:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        })
        if not moe:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


LAYOUTS = list(itertools.product((True, False), (True, False)))  # (sequence parallel, loss parallel)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
@pytest.mark.parametrize("sp,lp", LAYOUTS)
def test_llama_plan_unchanged(monkeypatch, flavor, sp, lp):
    args = llama3_configs[flavor]
    calls = recorded_plans(monkeypatch, parallelize_llama.apply_tp, build(Transformer, args),
                           loss_parallel=lp, sequence_parallel=sp)
    assert calls == [("Transformer", describe(root_plan(sp, lp)))] + \
        [("TransformerBlock", describe(llama_block_plan(sp)))] * args.n_layers


@pytest.mark.parametrize("converted", [True, False])
@pytest.mark.parametrize("sp", [True, False])
def test_llama_float8_plan_unchanged(monkeypatch, converted, sp):
    """float8 asked: torchao's styles where apply_float8 converted every projection, else the plain plan."""
    pytest.importorskip("torchao.float8")
    from torchtitan.parallelisms.float8 import float8_tp_styles

    monkeypatch.setattr(decoder_tp_plan, "is_float8", lambda module: converted)
    args = llama3_configs["debugmodel"]
    calls = recorded_plans(monkeypatch, parallelize_llama.apply_tp, build(Transformer, args),
                           loss_parallel=True, sequence_parallel=sp, float8=True)
    block = llama_block_plan(sp, float8_tp_styles()) if converted else llama_block_plan(sp)
    assert calls == [("Transformer", describe(root_plan(sp, True)))] + [("TransformerBlock", describe(block))] * 8


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
@pytest.mark.parametrize("sp,lp", LAYOUTS)
def test_qwen3_plan_unchanged(monkeypatch, flavor, sp, lp):
    args = qwen3_configs[flavor]
    calls = recorded_plans(monkeypatch, parallelize_qwen3.apply_tp, build(Qwen3, args),
                           loss_parallel=lp, sequence_parallel=sp)
    assert calls == [("Qwen3", describe(root_plan(sp, lp)))] + \
        [("TransformerBlock", describe(qwen3_block_plan(sp, args.is_moe)))] * args.n_layers


def test_llama_plan_keeps_its_order():
    """The shared plan lists Llama's modules in the order Llama's own plan did (parallelize_module
    applies them in that order)."""
    block = build(Transformer, llama3_configs["debugmodel"]).layers["0"]
    for sp in (True, False):
        assert list(decoder_tp_plan.decoder_block_plan(block, sp)) == list(llama_block_plan(sp))
