"""The semi-synchronous modes' outer loop (torchtitan/parallelisms/semi_sync.py), in one process:
the update rules against hand computations, and SemiSync's syncs, discards and live state with a
stand-in for the replica groups that plays the other group's side of the all-reduce."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.parallelisms.semi_sync import SemiSync, local_sgd_update, nesterov_outer_update


def test_local_sgd_takes_the_average_of_the_groups_parameters():
    backup = torch.tensor([1.0, 2.0, -3.0])
    mine, other = torch.tensor([0.5, 2.5, -3.0]), torch.tensor([1.5, 1.0, -2.0])
    avg_drift = ((backup - mine) + (backup - other)) / 2
    (new,) = local_sgd_update([backup], [avg_drift])
    assert torch.allclose(new, torch.tensor([1.0, 1.75, -2.5]))  # (mine + other) / 2, by hand


def test_nesterov_outer_step_matches_a_hand_computation_over_two_syncs():
    lr, mu = 0.7, 0.9
    backup, m = torch.tensor([1.0, -2.0]), torch.zeros(2)
    g1 = torch.tensor([0.2, -0.4])
    (p1,) = nesterov_outer_update([backup], [g1], [m], lr, mu)
    # m = g1; update = g1 + 0.9 g1 = 1.9 g1; p = backup - 0.7 * 1.9 * g1
    assert torch.allclose(m, g1)
    assert torch.allclose(p1, torch.tensor([1.0 - 0.266, -2.0 + 0.532]))
    g2 = torch.tensor([0.1, 0.0])
    (p2,) = nesterov_outer_update([p1], [g2], [m], lr, mu)
    # m = 0.9 * g1 + g2 = [0.28, -0.36]; update = g2 + 0.9 m = [0.352, -0.324]
    assert torch.allclose(m, torch.tensor([0.28, -0.36]))
    assert torch.allclose(p2, p1 - 0.7 * torch.tensor([0.352, -0.324]))
    # and it is torch.optim.SGD's Nesterov step on the same gradients
    x = nn.Parameter(backup.clone())
    sgd = torch.optim.SGD([x], lr=lr, momentum=mu, nesterov=True)
    for g in (g1, g2):
        x.grad = g.clone()
        sgd.step()
    assert torch.allclose(x.detach(), p2)


class _Groups:
    """Stands in for ReplicaGroups: the all-reduce averages this rank's drifts with `peer_drift`,
    commit answers `commits`; it records what the outer loop asked of it."""

    def __init__(self, method: str, every: int, commits: bool = True):
        self.ft = SimpleNamespace(semi_sync_method=method, sync_steps=every, outer_lr=0.5, outer_momentum=0.5)
        self.registered, self.commits, self.peer_drift = {}, commits, None
        self.manager = SimpleNamespace(register_state_dict_fn=lambda key, load, state: self.registered.update(
            {key: (load, state)}))
        self.calls, self.step_base = [], 0

    def count_syncs_from(self, base, every):
        self.calls.append(("count_syncs_from", base, every))

    def start_step(self):
        self.calls.append("start_step")

    def average_parameters_drift(self, drifts):
        for d, peer in zip(drifts, self.peer_drift):
            d.add_(peer).div_(2)

    def commit(self):
        return self.commits

    def record_sync_point(self):
        self.calls.append("record_sync_point")

    def rewind_to_sync_point(self):
        self.calls.append("rewind_to_sync_point")


class _Schedule:
    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def _outer_loop(method: str, every: int = 2, commits: bool = True, step: int = 0):
    torch.manual_seed(0)
    model, groups, schedule = nn.Linear(3, 2), _Groups(method, every, commits), _Schedule()
    state = SimpleNamespace(step=step, tokens_seen=0)
    return SemiSync(groups, [model], schedule, state), model, groups, schedule, state


def _inner_step(model, schedule, state, delta: float):
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(delta)
    schedule.steps += 1
    state.step += 1
    state.tokens_seen += 10


def test_a_sync_every_h_steps_averages_the_drift_and_applies_the_outer_rule():
    for method in ("local_sgd", "diloco"):
        outer, model, groups, schedule, state = _outer_loop(method)
        start = [p.detach().clone() for p in model.parameters()]
        _inner_step(model, schedule, state, 0.1)
        assert outer.after_update(1) and "start_step" not in groups.calls  # no sync between syncs
        _inner_step(model, schedule, state, 0.1)
        groups.peer_drift = [torch.full_like(p, 0.4) for p in model.parameters()]  # the other group moved 0.4
        assert outer.after_update(2)
        avg = 0.3  # (0.2 + 0.4) / 2
        # local SGD: the groups' mean parameters; DiLoCo (lr 0.5, mu 0.5, m = g): backup - 0.5 * 1.5 g
        want = avg if method == "local_sgd" else 0.5 * 1.5 * avg
        for p, s, b in zip(model.parameters(), start, outer.backup):
            assert torch.allclose(p.detach(), s - want)
            assert torch.equal(b, p.detach())  # the next drift is measured from here
        assert groups.calls[-1] == "record_sync_point" and outer.sync_point["step"] == 2


def test_a_sync_not_committed_goes_back_to_the_last_sync():
    outer, model, groups, schedule, state = _outer_loop("diloco", every=2, commits=False)
    start = [p.detach().clone() for p in model.parameters()]
    _inner_step(model, schedule, state, 0.1)
    _inner_step(model, schedule, state, 0.1)
    groups.peer_drift = [torch.zeros_like(p) for p in model.parameters()]
    assert not outer.after_update(2)
    assert all(torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start))
    assert (state.step, state.tokens_seen, schedule.steps) == (0, 0, 0)
    assert groups.calls[-1] == "rewind_to_sync_point"
    assert (outer.failed, outer.discarded) == (1, 2)
    assert all(torch.count_nonzero(m) == 0 for m in outer.momentum)  # the outer step was not taken


def test_live_state_carries_the_backup_momentum_and_counters():
    sender, model, groups, schedule, state = _outer_loop("diloco", step=4)
    assert groups.calls[0] == ("count_syncs_from", 4, 2)
    for m in sender.momentum:
        m.fill_(0.25)
    groups.step_base = 4
    sent = groups.registered["semi_sync"][1]()
    receiver, _, other_groups, _, _ = _outer_loop("diloco")
    with torch.no_grad():
        for b in receiver.backup:
            b.zero_()
    other_groups.registered["semi_sync"][0](sent)
    assert all(torch.equal(a, b) for a, b in zip(receiver.backup, sender.backup))
    assert all(torch.equal(a, b) for a, b in zip(receiver.momentum, sender.momentum))
    assert receiver.sync_point["step"] == 4 and other_groups.step_base == 4


def test_resuming_between_syncs_is_reported(caplog):
    _outer_loop("local_sgd", every=4, step=6)
    assert "between syncs" in caplog.text


def test_semi_sync_needs_fault_tolerance():
    with pytest.raises(ConfigError, match="needs fault_tolerance.enable"):
        parse_args(["--fault_tolerance.semi_sync_method", "diloco"])


def test_checkpoints_of_a_semi_sync_run_fall_on_syncs():
    with pytest.raises(ConfigError, match="checkpoint.interval 25 must be a multiple of fault_tolerance.sync_steps 10"):
        parse_args(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse",
                    "localhost:1", "--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps",
                    "10", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "25"])
    parse_args(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse",
                "localhost:1", "--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps",
                "10", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "30"])


class _Shard:
    """A data position: the batches read from a shard so far."""

    def __init__(self):
        self.read = 0

    def next_batch(self):
        self.read += 1
        return [self.read]

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.read = state["read"]


def _data_side(tmp_path, shard: _Shard, consumed: list[int]):
    """ReplicaGroups' data bookkeeping alone (no torchft manager): what a process of group 0 starts with."""
    from torchtitan.parallelisms.fault_tolerance import Ledger, ReplicaGroups
    from torchtitan.parallelisms.shard_position import ShardPosition

    groups = ReplicaGroups.__new__(ReplicaGroups)
    groups.replica_id, groups.steps_per_commit, groups.step_base, groups._held = 0, 1, 0, None
    groups.ledger, groups._train_state = Ledger(consumed=consumed), SimpleNamespace(step=0)
    groups.manager = SimpleNamespace(load_state_dict=lambda state: None)
    groups.position = ShardPosition(shard, str(tmp_path), group_rank=0, replica_id=0)
    return groups


def test_a_discarded_sync_reads_its_batches_again(tmp_path):
    shard = _Shard()
    groups = _data_side(tmp_path, shard, [0, 0])
    groups.count_syncs_from(0, 3)
    for _ in range(3):
        groups.draw(shard.next_batch)
    groups.record_sync_point()  # a committed sync after 3 batches
    assert [groups.draw(shard.next_batch) for _ in range(2)] == [[4], [5]]  # no batch is held between syncs
    groups.rewind_to_sync_point()
    assert (shard.read, groups.position.drawn) == (3, 3)
    assert groups.draw(shard.next_batch) == [4]


def test_a_restarted_group_recovers_its_data_position_from_its_last_sync(tmp_path):
    shard = _Shard()
    first = _data_side(tmp_path, shard, [0, 0])
    first.count_syncs_from(0, 3)
    for _ in range(3):
        first.draw(shard.next_batch)
    first.record_sync_point()
    for _ in range(2):  # then it dies two batches into the next sync
        first.draw(shard.next_batch)
    shard = _Shard()  # the restarted process reads its shard from the start
    second = _data_side(tmp_path, shard, [0, 0])
    second.count_syncs_from(0, 3)
    for _ in range(2):
        second.draw(shard.next_batch)
    second.ledger.consumed[:] = [3, 3]  # the peer's ledger: one sync of 3 batches with this group in it
    second._move_data_to_ledger()
    assert (shard.read, second.position.drawn) == (3, 3)  # only the previous life's sync record names batch 3
