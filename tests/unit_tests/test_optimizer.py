"""Tests for torchtitan.trainer.optimizer: lr_factor shapes, optimizer choice, schedulers and state round trips."""

import copy
import math

import pytest
import torch
from torch import nn

from tests.tolerances import reordered_sums
from torchtitan.config.manager import JobConfig
from torchtitan.parallelisms.zero1 import assign_owners
from torchtitan.trainer.optimizer import OptimizersContainer, build_lr_schedulers, build_optimizers, lr_factor


def test_warmup_rises_linearly_to_one():
    w = 4
    factors = [lr_factor(s, w, 20, "linear", 0.0) for s in range(w + 1)]
    assert factors[0] == pytest.approx(1 / (w + 1))
    assert factors[w] == pytest.approx(1.0)
    steps = [b - a for a, b in zip(factors, factors[1:])]
    assert steps == pytest.approx([1 / (w + 1)] * w)


def test_no_warmup_starts_at_peak():
    assert lr_factor(0, 0, 10, "linear", 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize("lr_min", [0.0, 0.1])
def test_linear_decay_reaches_lr_min_at_the_last_step(lr_min):
    w, total = 2, 12
    factors = [lr_factor(s, w, total, "linear", lr_min) for s in range(w, total + 1)]
    assert factors[-1] == pytest.approx(lr_min)
    assert factors[-2] > lr_min
    diffs = [a - b for a, b in zip(factors, factors[1:])]
    assert diffs == pytest.approx([(1 - lr_min) / (total - w)] * (total - w))
    assert lr_factor(total + 5, w, total, "linear", lr_min) == pytest.approx(lr_min)  # clamped afterwards


def test_cosine_decay_shape():
    w, total, lr_min = 2, 10, 0.1
    assert lr_factor(w, w, total, "cosine", lr_min) == pytest.approx(1.0)
    assert lr_factor(w + 4, w, total, "cosine", lr_min) == pytest.approx(0.55)  # midpoint: halfway to lr_min
    quarter = lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi / 4))
    assert lr_factor(w + 2, w, total, "cosine", lr_min) == pytest.approx(quarter)
    assert lr_factor(total, w, total, "cosine", lr_min) == pytest.approx(lr_min)


def test_constant_after_warmup():
    assert [lr_factor(s, 3, 10, "constant", 0.2) for s in range(3, 15)] == pytest.approx([1.0] * 12)


def test_unknown_decay_type():
    with pytest.raises(ValueError):
        lr_factor(5, 0, 10, "exponential", 0.0)


def job_config(name="AdamW", lr=0.01, warmup=2, steps=10, decay="linear", lr_min=0.1):
    config = JobConfig()
    config.optimizer.name, config.optimizer.lr = name, lr
    t = config.training
    t.warmup_steps, t.steps, t.decay_type, t.lr_min = warmup, steps, decay, lr_min
    return config


def model_parts(seed=0):
    torch.manual_seed(seed)
    return [nn.ModuleDict({"a": nn.Linear(4, 3)}), nn.ModuleDict({"b": nn.Linear(3, 2)})]


def train_steps(parts, optimizers, schedulers, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        optimizers.zero_grad()
        x = torch.randn(5, 4, generator=gen)
        parts[1]["b"](parts[0]["a"](x)).pow(2).mean().backward()
        optimizers.step()
        if schedulers is not None:
            schedulers.step()


@pytest.mark.parametrize("name,cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
def test_optimizer_chosen_by_name(name, cls):
    config = job_config(name=name)
    config.optimizer.weight_decay = 0.05
    parts = model_parts()
    optimizers = build_optimizers(parts, config)
    assert len(optimizers.optimizers) == 2
    for part, optimizer in zip(parts, optimizers.optimizers):
        assert type(optimizer) is cls
        (group,) = optimizer.param_groups
        assert [id(p) for p in group["params"]] == [id(p) for p in part.parameters()]
        assert group["lr"] == pytest.approx(0.01)
        assert group["betas"] == (config.optimizer.beta1, config.optimizer.beta2)
        assert group["weight_decay"] == pytest.approx(0.05)


def expected_factor(step, warmup=2, steps=10, lr_min=0.1):
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return lr_min + (1 - lr_min) * max(0.0, 1 - (step - warmup) / (steps - warmup))


def test_param_group_lr_follows_schedule():
    parts = model_parts()
    config = job_config()
    optimizers = build_optimizers(parts, config)
    schedulers = build_lr_schedulers(optimizers, config)
    for step in range(12):
        for optimizer in optimizers.optimizers:
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * expected_factor(step))
        assert schedulers.get_last_lr() == pytest.approx(0.01 * expected_factor(step))
        train_steps(parts, optimizers, schedulers, 1)


def test_lr_schedulers_round_trip():
    config = job_config(decay="cosine")
    parts = model_parts()
    optimizers = build_optimizers(parts, config)
    schedulers = build_lr_schedulers(optimizers, config)
    train_steps(parts, optimizers, schedulers, 5)
    state = schedulers.state_dict()

    fresh_parts = model_parts()
    fresh_optimizers = build_optimizers(fresh_parts, config)
    fresh = build_lr_schedulers(fresh_optimizers, config)
    assert fresh.get_last_lr() != pytest.approx(schedulers.get_last_lr())
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())
    for a, b in zip(optimizers.optimizers, fresh_optimizers.optimizers):
        assert b.param_groups[0]["lr"] == pytest.approx(a.param_groups[0]["lr"])
    schedulers.step()
    fresh_optimizers.step()  # no gradients: changes nothing, but keeps LambdaLR's call-order check quiet
    fresh.step()
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())
    assert fresh_optimizers.optimizers[1].param_groups[0]["lr"] == pytest.approx(0.01 * lr_factor(6, 2, 10, "cosine", 0.1))


def test_optimizers_round_trip():
    # One model part: with several parts the merged state dict loses all but the last (see the report).
    config = job_config(name="Adam")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizers = build_optimizers([model], config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        optimizers.zero_grad()
        model(torch.randn(5, 4, generator=gen)).pow(2).mean().backward()
        optimizers.step()
    # state_dict() hands out the live state tensors (as torch.optim does): copy, as a checkpoint would.
    state = copy.deepcopy(optimizers.state_dict())

    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fresh.load_state_dict(model.state_dict())
    fresh_optimizers = build_optimizers([fresh], config)
    fresh_optimizers.load_state_dict(state)
    (old,), (new,) = optimizers.optimizers, fresh_optimizers.optimizers
    for p_old, p_new in zip(model.parameters(), fresh.parameters()):
        assert torch.count_nonzero(old.state[p_old]["exp_avg"]) > 0
        torch.testing.assert_close(new.state[p_new]["exp_avg"], old.state[p_old]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(new.state[p_new]["exp_avg_sq"], old.state[p_old]["exp_avg_sq"], rtol=0, atol=0)
        assert float(new.state[p_new]["step"]) == float(old.state[p_old]["step"]) == 3.0

    # Both continue identically.
    x = torch.randn(5, 4, generator=gen)
    for m, o in ((model, optimizers), (fresh, fresh_optimizers)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p_old, p_new in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p_new, p_old, rtol=0, atol=0)


def test_resumed_lr_is_the_schedules_whatever_the_load_order():
    """A checkpoint written under a 10-step schedule, resumed under a 20-step one: the optimizer
    applies the rate the new schedule gives (and logs), not the one saved in its param groups.
    DCP loads the schedulers before the optimizers (it sorts names); both orders must agree."""
    parts = model_parts()
    optimizers = build_optimizers(parts, job_config(steps=10))
    schedulers = build_lr_schedulers(optimizers, job_config(steps=10))
    train_steps(parts, optimizers, schedulers, 5)
    saved_optim, saved_sched = copy.deepcopy(optimizers.state_dict()), schedulers.state_dict()
    expected = 0.01 * lr_factor(5, 2, 20, "linear", 0.1)
    for scheduler_first in (True, False):
        fresh_parts = model_parts()
        fresh = build_optimizers(fresh_parts, job_config(steps=20))
        fresh_sched = build_lr_schedulers(fresh, job_config(steps=20))
        loads = [(fresh_sched, saved_sched), (fresh, saved_optim)]
        for container, state in loads if scheduler_first else loads[::-1]:
            container.load_state_dict(state)
        assert fresh_sched.get_last_lr() == pytest.approx(expected)
        for optimizer in fresh.optimizers:
            assert optimizer.param_groups[0]["lr"] == pytest.approx(expected) != 0.01 * lr_factor(5, 2, 10, "linear", 0.1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_zero1_owners_balance_the_state_within_one_parameter(n):
    sizes = [577536, 65536, 16384, 16384, 65536, 196608, 196608, 196608, 256, 256] * 4 + [577536, 256]
    owners = assign_owners(sizes, n)
    assert sorted(set(owners)) == list(range(min(n, len(sizes))))
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
    assert sum(load) == sum(sizes)
    assert max(load) - min(load) <= max(sizes)  # greedy largest-first: within one parameter of even
    assert owners == assign_owners(list(sizes), n)  # every replica computes the same assignment


# ----------------------------------------------------------------------------- optimizer steps in backward


class TiedCheckpointedModel(nn.Module):
    """Small model with the two things that could see a parameter before its gradient is final or
    after its update: a weight used twice (tied output) and a recomputed (checkpointed) block."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.out(self.norm(h))


def train_tiny(early: bool, steps: int = 6, name: str = "AdamW"):
    config = job_config(name=name, lr=0.01, warmup=2, steps=steps)
    config.training.max_norm = 0.0
    config.optimizer.early_step_in_backward = early
    torch.manual_seed(0)
    model = TiedCheckpointedModel()
    optimizers = build_optimizers([model], config)
    schedulers = build_lr_schedulers(optimizers, config)
    gen = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(steps):
        optimizers.zero_grad()
        tokens = torch.randint(0, 11, (4, 5), generator=gen)
        logits = model(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten()).backward()
        if early:
            assert all(p.grad is None for p in model.parameters())  # applied and freed in backward
            norms.append(optimizers.grad_norm())
        else:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        optimizers.step()
        schedulers.step()
    return model, optimizers, schedulers, torch.stack(norms)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_early_step_in_backward_matches_the_usual_step(name):
    plain, plain_opt, plain_sched, plain_norms = train_tiny(early=False, name=name)
    early, early_opt, early_sched, early_norms = train_tiny(early=True, name=name)
    assert len(early_opt.optimizers) == len(list(early.parameters())) == 7  # one per parameter, the tied one once
    for (fqn, a), b in zip(plain.named_parameters(), early.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=fqn)  # same per-parameter math: bitwise on CPU
    # The norm sums every gradient element's square, per parameter as it is final, or all at once.
    norm_sums = sum(p.numel() for p in plain.parameters()) + len(list(plain.parameters()))
    torch.testing.assert_close(early_norms, plain_norms, rtol=reordered_sums(torch.float32, norm_sums)["rtol"], atol=0)
    assert early_sched.get_last_lr() == pytest.approx(plain_sched.get_last_lr())
    # Same checkpoint keys and values: a checkpoint moves between the two modes.
    plain_state, early_state = plain_opt.state_dict(), early_opt.state_dict()
    assert sorted(early_state) == sorted(plain_state)
    for key, value in plain_state.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(early_state[key], value, rtol=0, atol=0, msg=key)


def test_early_step_state_loads_into_the_usual_container():
    early, early_opt, _, _ = train_tiny(early=True)
    plain = TiedCheckpointedModel()
    plain.load_state_dict(early.state_dict())
    plain_opt = build_optimizers([plain], job_config())
    plain_opt.load_state_dict(copy.deepcopy(early_opt.state_dict()))
    (optimizer,) = plain_opt.optimizers
    # The early container holds one optimizer per parameter, in parameter order.
    for p_early, p_plain, per_param in zip(early.parameters(), plain.parameters(), early_opt.optimizers):
        saved = per_param.state[p_early]
        assert float(saved["step"]) == 6.0
        torch.testing.assert_close(optimizer.state[p_plain]["exp_avg_sq"], saved["exp_avg_sq"], rtol=0, atol=0)


class _OwnsOnly:
    """A stand-in for ZeRO-1's ReplicaOwnership: this replica owns the parameters `owned` holds."""

    def __init__(self, owned):
        self.owned = {id(p) for p in owned}

    def owns(self, p) -> bool:
        return id(p) in self.owned

    def broadcast_updates(self) -> None:  # one replica: nothing to send
        pass


@pytest.mark.parametrize("owned", ["vectors", "matrices"])
def test_a_zero1_replica_whose_muon_or_adamw_owns_nothing_saves_and_resumes(owned):
    """Under ZeRO-1 a replica may own no matrix (its Muon is empty) or only matrices (its AdamW is);
    torch's flattened optimizer state dict names each group by its first parameter, so an empty one
    must stay out of the state (the matrix's rep4 + ZeRO-1 + Muon point failed to resume: IndexError)."""
    from torchtitan.optimizers.muon import MuonSplit

    config = job_config(name="Muon")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    keep = [p for p in model.parameters() if (p.ndim == 1) == (owned == "vectors")]
    built = OptimizersContainer([model], torch.optim.AdamW, {"lr": 0.01}, _OwnsOnly(keep), MuonSplit.from_config(config))
    assert [len(o.param_groups[0]["params"]) == 0 for o in built.optimizers] == [owned == "matrices", owned == "vectors"]
    for _ in range(2):
        built.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        built.step()
    state = copy.deepcopy(built.state_dict())
    assert any(key.startswith("state.") for key in state)
    fresh = copy.deepcopy(model)
    fresh_keep = [q for p, q in zip(model.parameters(), fresh.parameters()) if any(p is k for k in keep)]
    again = OptimizersContainer([fresh], torch.optim.AdamW, {"lr": 0.01}, _OwnsOnly(fresh_keep),
                                MuonSplit.from_config(config))
    again.load_state_dict(state)
    restored = 0
    for old, new in zip(built.optimizers, again.optimizers):
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key, value in old.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    torch.testing.assert_close(new.state[q][key], value, rtol=0, atol=0)
                    restored += 1
    assert restored >= len(keep)
