"""Muon (torchtitan/optimizers/muon.py) in this process: the Newton-Schulz output is near-orthogonal,
a step equals a plain reference written here from the papers' formulas, the shape scale rules,
decoupled weight decay, the on-device non-finite skip, which parameters go to Muon, one
orthogonalisation per expert, and a DTensor parameter's step through the gather path. The parallel
layouts are compared with one process in the parity suite "muon" (tools/parity.py)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.tolerances import reordered_sums, rounded_ops
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.optimizers.muon import Muon, orthogonalize, update_scale, whole_matrices
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers

pytestmark = pytest.mark.fast
A, B, C = 3.4445, -4.7750, 2.0315


def reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration on one matrix, X <- aX + b(XX^T)X + c(XX^T)^2 X, without
    switching to the wide orientation (the odd polynomial gives the same matrix either way)."""
    x = g / g.norm()
    for _ in range(steps):
        s = x @ x.T
        x = A * x + B * (s @ x) + C * (s @ (s @ x))
    return x


def reference_steps(w0, grads, lr, wd, mu, scale, nesterov=True):
    """The Muon paper's form: B <- mu B + g; update g + mu B (Nesterov) or B; then Moonlight's
    W <- W - lr (scale * NS(update) + wd W). Returns the weights after each gradient."""
    w, b = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        b = mu * b + g
        u = g + mu * b if nesterov else b
        w = w - lr * (scale * reference_ns(u) + wd * w)
    return w


def steps_atol(w0, steps, lr, scale, longer_side):
    """How far two evaluations of Muon's steps may end apart: each step's Newton-Schulz runs 5
    iterations of three matmuls over at most `longer_side` terms, on values a few times 1 (the
    coefficients reach 4.8), summed in another order (or association); a step moves the weights by lr x
    scale x that. The momentum and decay take a few rounded operations on the weights."""
    ns = reordered_sums(torch.float32, 5 * 3 * longer_side, 5.0)["atol"]
    return steps * lr * scale * ns + rounded_ops(torch.float32, 6, float(w0.abs().max()))["atol"]


def step_muon(param, grads, **kwargs):
    optimizer = Muon([param], **kwargs)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (3, 24, 16)])
def test_newton_schulz_puts_singular_values_in_the_published_band(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(orthogonalize(g, 5, torch.float32))
    assert 0.68 <= s.min() and s.max() <= 1.2, (s.min(), s.max())
    s_input = torch.linalg.svdvals(g)
    assert (s_input.max(-1).values / s_input.min(-1).values > 3).all()  # the input was far from orthogonal


@pytest.mark.parametrize("rule,nesterov", [("match_adamw_rms", True), ("original", True), ("original", False)])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_steps_equal_the_reference_from_the_formulas(shape, rule, nesterov):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    lr, wd, mu = 0.02, 0.1, 0.9
    param = nn.Parameter(w0.clone())
    step_muon(param, grads, lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov, scale=rule)
    expected = reference_steps(w0, grads, lr, wd, mu, update_scale(shape, rule), nesterov)
    # The reference associates and orients its products otherwise.
    torch.testing.assert_close(param.detach(), expected, rtol=0,
                               atol=steps_atol(w0, len(grads), lr, update_scale(shape, rule), max(shape)))
    assert (param.detach() - w0).abs().max() > 1e-2  # it moved far more than the tolerance


def test_scale_rules():
    assert update_scale(torch.Size([128, 512]), "match_adamw_rms") == pytest.approx(0.2 * math.sqrt(512))
    assert update_scale(torch.Size([8, 512, 128]), "match_adamw_rms") == pytest.approx(0.2 * math.sqrt(512))
    assert update_scale(torch.Size([512, 128]), "original") == pytest.approx(2.0)
    assert update_scale(torch.Size([128, 512]), "original") == 1.0
    with pytest.raises(ValueError, match="unknown Muon update scale"):
        Muon([nn.Parameter(torch.zeros(2, 2))], lr=0.1, scale="rms")


def test_weight_decay_is_decoupled():
    """A zero gradient orthogonalises to zero: only the decay lr * weight_decay acts."""
    w0 = torch.randn(6, 5)
    param = nn.Parameter(w0.clone())
    step_muon(param, [torch.zeros(6, 5)], lr=0.1, weight_decay=0.5)
    torch.testing.assert_close(param.detach(), w0 * (1 - 0.1 * 0.5), rtol=0, atol=0)


def test_found_inf_skips_the_step_on_the_device():
    gen = torch.Generator().manual_seed(2)
    w0, g0, g1 = (torch.randn(8, 4, generator=gen) for _ in range(3))
    skipping, plain = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    optimizer, reference = step_muon(skipping, [g0], lr=0.05, weight_decay=0.1), step_muon(plain, [g0], lr=0.05, weight_decay=0.1)
    before, momentum = skipping.detach().clone(), optimizer.state[skipping]["momentum_buffer"].clone()
    optimizer.found_inf = torch.ones(())
    skipping.grad = torch.full_like(g1, float("nan"))
    optimizer.step()
    assert torch.equal(skipping.detach(), before) and torch.equal(optimizer.state[skipping]["momentum_buffer"], momentum)
    # found_inf 0: the same arithmetic as no flag at all, bit for bit.
    optimizer.found_inf = torch.zeros(())
    skipping.grad, plain.grad = g1.clone(), g1.clone()
    optimizer.step()
    reference.step()
    assert torch.equal(skipping.detach(), plain.detach())


class ToyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.router = nn.Linear(8, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) * 0.1)
        self.output = nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        h = self.norm(self.proj(self.tok_embeddings(tokens)))
        h = h + torch.einsum("bd,eod,be->bo", h, self.experts, self.router(h).softmax(-1))
        return self.output(h)


def muon_config(**options):
    config = JobConfig()
    config.optimizer.name, config.optimizer.lr = "Muon", 0.01
    config.training.warmup_steps, config.training.steps = 0, 10
    for k, v in options.items():
        setattr(config.optimizer, k, v)
    return config


@pytest.mark.parametrize("exclude,muon_names", [
    (["tok_embeddings", "output"], ["proj.weight", "router.weight", "experts"]),
    (["tok_embeddings", "output", "*router*"], ["proj.weight", "experts"]),
])
def test_matrices_go_to_muon_and_the_rest_to_adamw(exclude, muon_names):
    model = ToyMoE()
    optimizers = build_optimizers([model], muon_config(muon_exclude=exclude))
    adamw, muon = optimizers.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    assert type(adamw) is torch.optim.AdamW and type(muon) is Muon
    assert sorted(names[id(p)] for g in muon.param_groups for p in g["params"]) == sorted(muon_names)
    assert sorted(names[id(p)] for g in adamw.param_groups for p in g["params"]) == sorted(set(names.values()) - set(muon_names))
    # One LR schedule per optimizer, stepped together.
    schedulers = build_lr_schedulers(optimizers, muon_config(muon_exclude=exclude))
    assert len(schedulers.schedulers) == 2
    tokens = torch.randint(0, 16, (5,))
    model(tokens).logsumexp(-1).mean().backward()
    optimizers.step()
    assert set(optimizers.state_dict()) >= {"state.experts.momentum_buffer", "state.output.weight.exp_avg"}


def test_a_pattern_names_a_parameter_inside_a_checkpointed_block():
    # Activation checkpointing wraps a block, and the model's named_parameters() then name its
    # parameters through the wrapper (`proj._checkpoint_wrapped_module.weight`); patterns match the
    # bare names, as the config's check (on the unwrapped model) saw them.
    from torchtitan.runtime.torch_compat.composable import checkpoint_wrapper

    model = ToyMoE()
    model.proj = checkpoint_wrapper(model.proj)
    optimizers = build_optimizers([model], muon_config(muon_exclude=["tok_embeddings", "output", "proj"]))
    muon = optimizers.optimizers[1]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for g in muon.param_groups for p in g["params"]) == ["experts", "router.weight"]


def preflight_muon(tmp_path, *argv):
    from tests.helpers import TINY_RUN
    from torchtitan.config.preflight import preflight

    config = parse_args([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--optimizer.name", "Muon", *argv])
    return preflight(config, world_size=1, device_type="cpu", check_memory=False)


@pytest.mark.parametrize("exclude,kept", [
    ("no_such_param", "; the list replaces the default, so add tok_embeddings,output to keep those with AdamW"),
    ("output,no_such_param", "; the list replaces the default, so add tok_embeddings to keep those with AdamW"),
    ("tok_embeddings,output,no_such_param", "")])
def test_a_muon_exclude_pattern_that_matches_nothing_is_refused(tmp_path, exclude, kept):
    with pytest.raises(ConfigError) as refused:
        preflight_muon(tmp_path, "--optimizer.muon_exclude", exclude)
    assert refused.value.line == (
        "error: optimizer.muon_exclude 'no_such_param' matches no parameter of model llama3 tiny (named like "
        "tok_embeddings.weight, layers.1.attention.wq.weight, output.weight: give a name prefix or an fnmatch "
        f"pattern){kept}")


@pytest.mark.parametrize("argv", [["--model.flavor", "tiny_tied"],  # output.weight is tok_embeddings.weight
                                  ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
                                  ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
                                  ["--optimizer.muon_exclude", "tok_embeddings,output,*.attention.w?.*,layers.0"]])
def test_the_default_and_real_patterns_match_every_family(tmp_path, argv):
    preflight_muon(tmp_path, *argv)


def test_experts_are_orthogonalised_one_by_one():
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(3, 16, 8, generator=gen)
    grads = [torch.randn(3, 16, 8, generator=gen) for _ in range(2)]
    stacked = nn.Parameter(w0.clone())
    step_muon(stacked, grads, lr=0.02, weight_decay=0.1)
    for e in range(3):
        alone = nn.Parameter(w0[e].clone())
        step_muon(alone, [g[e] for g in grads], lr=0.02, weight_decay=0.1)
        # One batched matmul against one per matrix: other kernels, the same formula.
        atol = steps_atol(w0, len(grads), 0.02, update_scale(w0.shape, "match_adamw_rms"), 16)
        torch.testing.assert_close(stacked.detach()[e], alone.detach(), rtol=0, atol=atol)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_a_dtensor_matrix_steps_as_the_whole_tensor(ns_dtype):
    """A row-sharded DTensor (one-rank gloo mesh: the gather and slice path, not its communication,
    which the parity suite's layouts exercise) gives the plain tensor's step, also with bf16
    iterations (gathered in bf16)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(4)
        w0, g = torch.randn(12, 6, generator=gen), torch.randn(12, 6, generator=gen)
        plain, sharded = nn.Parameter(w0.clone()), nn.Parameter(distribute_tensor(w0.clone(), mesh, [Shard(0)]))
        step_muon(plain, [g], lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype)
        optimizer = Muon([sharded], lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype)
        sharded.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        optimizer.step()
        assert torch.equal(sharded.full_tensor(), plain.detach())
        assert optimizer.state[sharded]["momentum_buffer"].placements == (Shard(0),)
    finally:
        dist.destroy_process_group()


def test_muon_options_are_checked():
    with pytest.raises(ConfigError, match="optimizer.muon_momentum must lie in"):
        parse_args(["--optimizer.name", "Muon", "--optimizer.muon_momentum", "1.0"])
    with pytest.raises(ConfigError, match="optimizer.muon_ns_steps must lie in"):
        parse_args(["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"])
    with pytest.raises(ConfigError, match="optimizer.name Muon does not compose with training.enable_cpu_offload"):
        parse_args(["--optimizer.name", "Muon", "--training.enable_cpu_offload"])


def test_only_the_mesh_dims_that_split_a_matrix_dim_are_gathered():
    # FSDP over TP's row split of the same dim: a _StridedShard (not a Shard subclass) and a Shard.
    assert whole_matrices([_StridedShard(0, split_factor=2), Shard(0)], 2) == [Replicate(), Replicate()]
    assert whole_matrices([Replicate(), Shard(1)], 2) == [Replicate(), Replicate()]  # HSDP replicas x TP columns
    assert whole_matrices([Shard(-1)], 2) == [Replicate()]
    # Experts [E, out, in]: the expert split stays, a row or column split is gathered.
    assert whole_matrices([Shard(0), Shard(1)], 3) == [Shard(0), Replicate()]
    assert whole_matrices([Partial(), Shard(0)], 3) == [Partial(), Shard(0)]


@pytest.mark.parametrize("argv,message", [
    (["--steps", "10", "--warmup-steps", "20"], "--steps must be >= 1 and >= --warmup-steps"),
    (["--batch-size", "6", "--nproc", "4"], "--batch-size 6 must divide by --nproc 4"),
    (["--lrs", "1e-3", "0"], "every --lrs value must be > 0"),
])
def test_the_sweep_script_refuses_bad_arguments(argv, message, capsys):
    from scripts.optimizer_sweep import parse_args as sweep_args

    with pytest.raises(SystemExit):
        sweep_args(argv)
    assert message in capsys.readouterr().err
    assert sweep_args(["--steps", "20", "--warmup-steps", "2"]).optimizers == ["AdamW", "Muon"]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_a_bf16_momentum_steps_like_fp32_within_its_rounding_and_resumes_exactly(stochastic):
    """optimizer.state_dtype bfloat16 with Muon: the momentum is held in bf16 (half the bytes) and
    each step equals the fp32-state step from the bf16-rounded momentum; a state dict round trip
    (the momentum and the param groups' rounding_step) continues bitwise, stochastic noise included."""
    gen = torch.Generator().manual_seed(4)
    w0, *grads = (torch.randn(16, 8, generator=gen) for _ in range(4))
    state = {"state_dtype": torch.bfloat16, "stochastic_rounding": stochastic}
    low, full = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    optimizer = step_muon(low, grads[:2], lr=0.05, weight_decay=0.1, **state)
    buf = optimizer.state[low]["momentum_buffer"]
    assert buf.dtype == torch.bfloat16
    reference = Muon([full], lr=0.05, weight_decay=0.1)
    for g in grads[:2]:
        full.grad = g.clone()
        reference.step()
    torch.testing.assert_close(low.detach(), full.detach(), atol=2e-3, rtol=0)  # bf16's ulp at the momentum's size
    torch.testing.assert_close(buf.float(), reference.state[full]["momentum_buffer"], atol=1e-2, rtol=1e-2)
    # Resumed from a state dict into a new optimizer: the third step is bitwise the uninterrupted one.
    resumed_param = nn.Parameter(low.detach().clone())
    resumed = Muon([resumed_param], lr=0.05, weight_decay=0.1, **state)
    resumed.load_state_dict(optimizer.state_dict())
    low.grad, resumed_param.grad = grads[2].clone(), grads[2].clone()
    optimizer.step()
    resumed.step()
    assert torch.equal(low.detach(), resumed_param.detach())
    assert torch.equal(optimizer.state[low]["momentum_buffer"], resumed.state[resumed_param]["momentum_buffer"])
    assert resumed.state[resumed_param]["momentum_buffer"].dtype == torch.bfloat16
