"""LoRA in one process (torchtitan/parallelisms/lora_linear.py, parallelisms/lora.py; docs/lora.md): zero-initialised
adapters leave the model's output as it was, a merged weight computes what base and adapters do, the
base gets no gradient and no optimizer state, the adapters' initial values depend on the layer's name
only (so every layout draws the same), what lora.target_modules names in each family, the model
rule's one-line refusals, the adapters' TP placements, op-level checkpointing of the adapters' path,
and which state a LoRA run's checkpoints hold and load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torchtitan.checkpoint import lora as lora_checkpoint
from torchtitan.checkpoint.folders import CheckpointError, Manifest
from torchtitan.checkpoint.resume import ResumePoint
from torchtitan.config.manager import parse_args, read_config
from torchtitan.errors import ConfigError
from torchtitan.estimation.dry_run import dry_run
from torchtitan.models import get_train_spec
from torchtitan.parallelisms.activation_checkpoint import _save_expensive_ops
from torchtitan.parallelisms.lora import adapter_placements, apply_lora, check_targets, init_adapters
from torchtitan.parallelisms.lora_linear import is_adapted, merge_weight, select_targets
from torchtitan.trainer.optimizer import build_optimizers

FAMILIES = [("llama3", "tiny"), ("qwen3", "tiny"), ("qwen3", "tiny_moe"), ("deepseek_v3", "tiny")]
VOCAB = 256


def job(*args: str):
    return parse_args(["--checkpoint.initial_load_path", "base", "--lora.rank", "4", *args])


def model_of(name: str, flavor: str, seed: int = 0) -> nn.Module:
    spec = get_train_spec(name)
    args = dataclasses.replace(spec.config[flavor], vocab_size=VOCAB, max_seq_len=32)
    torch.manual_seed(seed)
    model = spec.model_cls.from_model_args(args)
    model.init_weights()
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def adapted(name: str, flavor: str, *options: str) -> nn.Module:
    model = model_of(name, flavor)
    apply_lora(model, job("--model.name", name, "--model.flavor", flavor, *options).lora)
    init_adapters(model, seed=0)
    return model


def randomize_b(model: nn.Module) -> None:
    """Adapters as training leaves them: B no longer zero."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if is_adapted(m):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=g) * 0.1)


@pytest.mark.parametrize("name,flavor", FAMILIES)
def test_fresh_adapters_leave_the_output_unchanged(name, flavor):
    base = model_of(name, flavor)
    model = adapted(name, flavor)
    assert any(is_adapted(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(tokens()), base(tokens()))  # B is zero: bitwise the base's logits


@pytest.mark.parametrize("name,flavor", FAMILIES)
def test_merged_weights_compute_what_base_and_adapters_do(name, flavor):
    model = adapted(name, flavor, "--lora.alpha", "8")
    randomize_b(model)
    merged = model_of(name, flavor)
    state = merged.state_dict()
    with torch.no_grad():
        for layer, m in select_targets(model, ["all-linear"]).items():
            state[f"{layer}.weight"] = merge_weight(m.weight, m.lora_a.weight, m.lora_b.weight, m.lora_scale)
    merged.load_state_dict(state)
    with torch.no_grad():
        ours, theirs = model(tokens()), merged(tokens())
    assert (ours - model_of(name, flavor)(tokens())).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_base_is_frozen_and_only_the_adapters_are_optimized():
    model = adapted("llama3", "tiny")
    randomize_b(model)  # so that A gets a gradient too
    model(tokens()).sum().backward()
    for name, p in model.named_parameters():
        adapter = ".lora_a." in name or ".lora_b." in name
        assert p.requires_grad == adapter, name
        assert (p.grad is not None) == adapter, name
        assert p.dtype == torch.float32
    optimizers = build_optimizers([model], job())
    optimized = {id(p) for o in optimizers.optimizers for g in o.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if p.requires_grad}
    optimizers.step()
    state = optimizers.state_dict()
    assert state and all(".lora_" in k for k in state if k.startswith("state."))


def test_initial_values_depend_on_the_layer_name_only():
    """A pipeline stage holding block 1 alone draws block 1's adapters as the whole model does; the
    run's seed changes them."""
    whole = adapted("llama3", "tiny")
    stage = model_of("llama3", "tiny")
    del stage.layers["0"]
    apply_lora(stage, job().lora)
    init_adapters(stage, seed=0)
    a = "layers.1.attention.wq.lora_a.weight"
    assert torch.equal(whole.state_dict()[a], stage.state_dict()[a])
    assert not torch.equal(whole.state_dict()[a], whole.state_dict()["layers.1.attention.wk.lora_a.weight"][:, :])
    other = model_of("llama3", "tiny")
    apply_lora(other, job().lora)
    init_adapters(other, seed=1)
    assert not torch.equal(whole.state_dict()[a], other.state_dict()[a])
    assert not whole.state_dict()["layers.1.attention.wq.lora_b.weight"].any()


@pytest.mark.parametrize("name,flavor,expected", [
    ("llama3", "tiny", {"attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                        "feed_forward.w2", "feed_forward.w3"}),
    ("qwen3", "tiny_moe", {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}),
    ("deepseek_v3", "tiny", {"attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo",
                             "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "shared_experts.w1",
                             "shared_experts.w2", "shared_experts.w3"}),
])
def test_all_linear_is_every_block_linear_but_routers(name, flavor, expected):
    with torch.device("meta"):
        model = get_train_spec(name).model_cls.from_model_args(get_train_spec(name).config[flavor])
    targets = select_targets(model, ["all-linear"])
    assert {t.split(".", 2)[-1] if t.startswith("layers.") else t.split(".block.", 1)[-1] for t in targets} == expected
    assert "output" not in targets and not any(".router." in t for t in targets)
    # Named explicitly, the output projection and a router are targets too; patterns match a trailing part.
    assert set(select_targets(model, ["output", "layers.0.attention.wo"])) == {"output", "layers.0.attention.wo"}
    if name == "qwen3":
        assert set(select_targets(model, ["*.router.gate"])) == {"layers.0.moe.router.gate", "layers.1.moe.router.gate"}


@pytest.mark.parametrize("name,flavor,options,line", [
    ("llama3", "tiny", ("--lora.target_modules", "wq,foo"), "lora.target_modules 'foo' matches no linear layer of model "
     "llama3 (its linear layers: attention.wq, attention.wk, attention.wv, attention.wo, feed_forward.w1, "
     "feed_forward.w2, feed_forward.w3, output)"),
    ("qwen3", "tiny_moe", ("--lora.target_modules", "experts"), "lora.target_modules 'experts' names the routed experts "
     "of model qwen3 (layers.0.moe.experts.w1), whose weights are grouped 3-D tensors"),
    ("llama3", "tiny", ("--lora.rank", "65"), "lora.rank 65 is above what layers.0.attention.wk of model llama3 tiny can "
     "use (128 inputs, 64 outputs): a rank of at most 64 for it"),
    ("qwen3", "tiny", ("--lora.target_modules", "output"), "lora.target_modules names output, which model qwen3 tiny "
     "ties to tok_embeddings: a merged adapter would change tok_embeddings too; leave output out"),
])
def test_the_model_rule_refuses_with_one_line(name, flavor, options, line):
    config = job("--model.name", name, "--model.flavor", flavor, *options)
    with torch.device("meta"):
        model = get_train_spec(name).model_cls.from_model_args(get_train_spec(name).config[flavor])
    with pytest.raises(ConfigError) as e:
        check_targets(config, model)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_adapters_follow_the_base_layers_tp_split():
    assert adapter_placements((Shard(0),)) == ([Replicate()], [Shard(0)])  # column-wise: B split by rows
    assert adapter_placements((Shard(1),)) == ([Shard(1)], [Replicate()])  # row-wise: A split by columns
    assert adapter_placements((Replicate(),)) == ([Replicate()], [Replicate()])


def test_op_level_checkpointing_recomputes_the_adapters_low_rank_matmuls():
    mm, save, recompute = torch.ops.aten.mm.default, "MUST_SAVE", "PREFER_RECOMPUTE"
    low_rank, wide = torch.empty(8, 4), torch.empty(8, 128)
    assert _save_expensive_ops(None, mm, low_rank, torch.empty(4, 64), low_rank=frozenset({4})).name == recompute
    assert _save_expensive_ops(None, mm, wide, torch.empty(128, 64), low_rank=frozenset({4})).name == save
    assert _save_expensive_ops(None, mm, low_rank, torch.empty(4, 64)).name == save  # no LoRA: as before


def _point(weights_only: bool, lora: dict | None) -> ResumePoint:
    return ResumePoint("ckpt", weights_only, Manifest(step=0 if weights_only else 5, contents=["model"] if weights_only
                                                      else ["model", "optimizer"], lora=lora))


def test_a_lora_run_loads_its_base_then_its_adapters(tmp_path):
    base = tmp_path / "base"  # never written: the adapters-only checkpoint's base is looked for and not found
    config = job("--checkpoint.initial_load_path", str(base))
    assert lora_checkpoint.loads_for(_point(True, None), config) == [(_point(True, None), lora_checkpoint.BASE)]
    whole = _point(False, {"adapters_only": False})
    assert lora_checkpoint.loads_for(whole, config) == [(whole, lora_checkpoint.WHOLE)]
    assert lora_checkpoint.loads_for(whole, parse_args([])) == [(whole, lora_checkpoint.WHOLE)]  # no LoRA
    adapters_only = _point(False, {"adapters_only": True, "base": str(base)})
    with pytest.raises(CheckpointError, match="checkpoint.initial_load_path .* does not exist"):
        lora_checkpoint.loads_for(adapters_only, config)
    config.checkpoint.initial_load_path = ""
    with pytest.raises(CheckpointError, match=f"holds LoRA adapters without their base model \\(it was trained on {base}\\)"):
        lora_checkpoint.loads_for(adapters_only, config)


def test_the_saved_model_state_holds_the_adapters_alone():
    model = adapted("llama3", "tiny")
    saved = lora_checkpoint.saved_state([model], job()).state_dict()
    assert saved and all(".lora_a." in k or ".lora_b." in k for k in saved)
    whole = lora_checkpoint.saved_state([model], job("--lora.save_adapters_only", "false")).state_dict()
    assert set(whole) == set(model.state_dict())
    base = lora_checkpoint.model_state([model], lora_checkpoint.BASE).state_dict()
    assert set(base) | set(saved) == set(whole) and not set(base) & set(saved)


def test_lora_options_without_lora_get_a_notice():
    _, notices = read_config(["--lora.alpha", "32", "--lora.target_modules", "wq"])
    assert notices == ["lora.alpha, lora.target_modules have no effect: they apply to lora.rank > 0, and this job "
                       "trains every parameter (lora.rank is 0)"]
    assert read_config(["--lora.rank", "8", "--lora.alpha", "32", "--checkpoint.initial_load_path", "base"])[1] == []


@pytest.mark.parametrize("world", [1, 2])
def test_the_dry_run_shows_what_lora_saves(world):
    """One process (PyTorch's plain tracker, which hooks every parameter's gradient) and FSDP 2: the
    frozen base has no gradient and no optimizer state; the adapters' are a few percent of them."""
    args = ["--job.config_file", "bundled:train_configs/debug_model.toml", "--model.flavor", "tiny", "--training.seq_len",
            "128", "--job.dry_run", "--job.dry_run_device", "cpu", "--job.dry_run_world_size", str(world)]
    full = dry_run(parse_args(args)).ranks[0].memory
    lora = dry_run(parse_args([*args, "--lora.rank", "8", "--checkpoint.initial_load_path", "base"])).ranks[0]
    assert lora.parallelisms["lora"]["trainable_parameters"] == 45056
    for category in ("gradients", "optimizer"):
        assert 0 < lora.memory.category_max[category] < full.category_max[category] / 20, category


def test_the_start_up_memory_floor_counts_a_frozen_base_as_weights_only():
    """Llama 3 8B LoRA on one 80 GiB GPU fits (the dry run: 70 GiB); a floor of 16 bytes per
    parameter would refuse it at start-up."""
    from torchtitan.config.manager import validate_world_size
    from torchtitan.estimation.memory_floor import state_floor_bytes

    config = parse_args(["--lora.rank", "16", "--checkpoint.initial_load_path", "base"])
    dims = validate_world_size(config, 8)
    assert state_floor_bytes(config, dims, 8_000_000) == 4 * 8_000_000 // 8
