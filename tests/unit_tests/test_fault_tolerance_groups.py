"""ReplicaGroups' own logic, in one process: torchft's Manager is replaced by a stand-in whose peers
are simulated (their contributions to the all-reduce, the commit decision, a recovery). What it
proves: a step that is not committed trains its batch again; the ledger counts only the batches
of committed steps a group took part in; a recovering group lands on the ledger's data position;
groups with other configurations or a replica id used twice are refused; the live state a peer
sends restores model, optimizer (also into an optimizer that has not stepped yet) and schedule."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchtitan.checkpoint.states import TrainState
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError, Hang
from torchtitan.parallelisms import fault_tolerance
from torchtitan.parallelisms.fault_tolerance import ReplicaGroups, config_fingerprint, section_fingerprints
from torchtitan.parallelisms.live_state import live_state, load_live_state, named_tensors
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers


class _Work:
    def wait(self) -> bool:
        return True


class FakeManager:
    """The peers: `peers` groups (indices) that take part with the given config fingerprint and add
    `peer_value` to every averaged element."""

    def __init__(self, me: int, peers: list[int], fingerprints: list[int], peer_value: float = 1.0):
        self.me, self.peers, self.fingerprints, self.peer_value = me, peers, fingerprints, peer_value
        self.commit_answer, self.participating, self.step = True, True, 0
        self.load_fn = self.state_fn = None
        self._errored = None
        self.recovering_peers: set[int] = set()  # present in the quorum, taking no part in the average
        self.peer_died: str | None = None  # the error the quorum's process group raises

    def register_state_dict_fn(self, key, load_fn, state_fn):
        self.load_fn, self.state_fn = load_fn, state_fn

    def load_state_dict(self, state):
        self.step = state["step"]

    def start_quorum(self):
        pass

    def wait_quorum(self):
        pass

    def errored(self):
        return self._errored

    def num_participants(self) -> int:
        return len(self.peers) + int(self.participating)

    def current_step(self) -> int:
        return self.step

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def allreduce(self, tensor: torch.Tensor) -> _Work:
        if not self.participating:
            tensor.zero_()
        tensor += self.peer_value * len(self.peers)
        tensor /= self.num_participants()
        return _Work()

    def should_commit(self) -> bool:
        if self.commit_answer:
            self.step += 1
        return self.commit_answer

    def shutdown(self, wait=False):
        pass


class FakeQuorumGroup:
    """The quorum's process group, where the bookkeeping numbers are summed over every group present:
    each peer adds its one-hot slots (taking part, present) and its configuration fingerprint."""

    def __init__(self, manager: FakeManager):
        self.manager = manager

    def allreduce(self, tensors: list[torch.Tensor], op) -> _Work:
        if self.manager.peer_died is not None:
            raise RuntimeError(self.manager.peer_died)
        (tail,) = tensors
        slots = torch.tensor(fault_tolerance._fingerprint_slots(self.manager.fingerprints), dtype=torch.float64)
        groups = (len(tail) - len(slots)) // 2
        for peer in self.manager.peers:
            tail[peer] += peer not in self.manager.recovering_peers
            tail[groups + peer] += 1
            tail[2 * groups:] += slots
        return _Work()


class Loader:
    """A data position that counts the batches drawn."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def next(self):
        self.position += 1
        return f"batch{self.position}"


def _config(tmp_path, groups=2, replica_id=0) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    ft = config.fault_tolerance
    ft.enable, ft.group_size, ft.replica_id, ft.lighthouse = True, groups, replica_id, "localhost:1"
    return config


def _groups(tmp_path, monkeypatch, peers=(1,), replica_id=0, groups=2, peer_config=None, train_state=None):
    """`peer_config(config)`: what the peers changed in their copy of this group's options."""
    config = _config(tmp_path, groups, replica_id)
    model = nn.Linear(4, 3)
    optimizers = build_optimizers([model], config, None)
    lr_schedulers = build_lr_schedulers(optimizers, config)
    train_state = train_state or TrainState(data_consumed=[0] * groups)
    theirs = _config(tmp_path, groups, replica_id)
    if peer_config is not None:
        peer_config(theirs)
    manager = FakeManager(replica_id, list(peers), list(section_fingerprints(theirs, 1).values()))
    def connect(self, rank, size):
        self._pg = FakeQuorumGroup(manager)
        return manager

    monkeypatch.setattr(ReplicaGroups, "_connect", connect)
    loader = Loader()
    rg = ReplicaGroups(config, 0, 1, torch.device("cpu"), [model], optimizers, lr_schedulers, train_state, loader)
    return rg, manager, loader, model


def _step(rg: ReplicaGroups, loader: Loader, model: nn.Module) -> tuple[str, bool]:
    rg.start_step()
    batch = rg.draw(loader.next)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    rg.average_gradients(list(model.parameters()))
    return batch, rg.commit()


def test_a_step_not_committed_trains_its_batch_again_and_counts_nothing(tmp_path, monkeypatch):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch)
    assert _step(rg, loader, model) == ("batch1", True)
    assert rg.ledger.consumed == [1, 1] and model.weight.grad.eq(1.0).all()  # (1 + peer's 1) / 2
    manager.commit_answer = False
    assert _step(rg, loader, model) == ("batch2", False)
    assert rg.ledger.consumed == [1, 1] and rg.ledger.retried == 1
    manager.commit_answer = True
    assert _step(rg, loader, model) == ("batch2", True)  # the same batch, not the next
    assert _step(rg, loader, model) == ("batch3", True)
    assert rg.ledger.consumed == [3, 3] and rg.ledger.participants == [2, 2, 2]
    assert rg._train_state.step == 3  # the manager's count of committed steps


def test_the_ledger_counts_only_groups_that_took_part(tmp_path, monkeypatch):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peers=(1,), groups=3)
    _step(rg, loader, model)
    assert rg.ledger.consumed == [1, 1, 0] and rg.participating() == 2
    manager.peers = [1, 2]
    _step(rg, loader, model)
    assert rg.ledger.consumed == [2, 2, 1] and rg.participating() == 3


def test_a_recovering_group_lands_on_the_ledgers_data_position(tmp_path, monkeypatch):
    # Group 1 trained 3 batches of its shard, then died holding a 4th it had drawn.
    before, _, loader, model = _groups(tmp_path, monkeypatch, replica_id=1, peers=(0,))
    for _ in range(3):
        _step(before, loader, model)
    before.start_step()
    before.draw(loader.next)
    # It restarts from an older checkpoint (1 batch consumed) and recovers from group 0, whose ledger
    # says group 1's shard gave 3 batches to committed steps.
    state = TrainState(data_consumed=[1, 1])
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, replica_id=1, peers=(0,), train_state=state)
    loader.position = 1
    peer = copy.deepcopy(manager.state_fn())
    peer["ledger"]["consumed"] = [5, 3]
    rg.start_step()
    assert rg.draw(loader.next) == "batch2"  # drawn before the quorum told it to recover
    manager.participating = False  # a recovering group takes no part in the step it recovers in
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    rg.average_gradients(list(model.parameters()))
    manager.load_fn(peer)
    assert rg.commit()
    assert rg.ledger.consumed == [6, 3] and rg.ledger.healed == 1
    assert loader.position == 3 and rg.draw(loader.next) == "batch4"  # after the 3 its shard gave, not batch 3


def test_a_recovery_without_a_position_for_the_ledgers_count_says_so(tmp_path, monkeypatch, caplog):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, replica_id=1, peers=(0,))
    peer = copy.deepcopy(manager.state_fn())
    peer["ledger"]["consumed"] = [9, 7]
    rg.start_step()
    rg.draw(loader.next)
    manager.participating = False
    manager.load_fn(peer)
    rg.average_gradients(list(model.parameters()))
    rg.commit()
    assert "no data position for batch 7" in caplog.text and rg.ledger.consumed == [10, 7]
    assert rg.ledger.data_gaps == 1


def _other_lr_and_steps(config: JobConfig) -> None:
    config.optimizer.lr, config.training.steps = 1e-3, 7


def test_groups_with_another_configuration_are_refused_naming_where_they_differ(tmp_path, monkeypatch):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peer_config=_other_lr_and_steps)
    with pytest.raises(ConfigError, match=r"different configurations \(they differ in \[optimizer\], \[training\]\); "):
        _step(rg, loader, model)
    # What each group may set for itself is no difference.
    rg, manager, loader, model = _groups(tmp_path, monkeypatch,
                                         peer_config=lambda c: setattr(c.job, "dump_folder", str(tmp_path / "peer")))
    assert _step(rg, loader, model) == ("batch1", True)
    rg, manager, loader, model = _groups(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="another configuration"):
        manager.load_fn({**manager.state_fn(), "fingerprint": 1})


def test_a_recovering_peer_with_another_configuration_stops_this_group_too(tmp_path, monkeypatch):
    """A group that joins late recovers from this one and takes no part in the average: its
    fingerprint still reaches this group, which stops too instead of training on alone."""
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peer_config=_other_lr_and_steps)
    manager.recovering_peers = {1}
    with pytest.raises(ConfigError, match="different configurations"):
        _step(rg, loader, model)


def test_a_peer_that_dies_mid_step_is_one_warning_naming_it(tmp_path, monkeypatch, caplog):
    """torchft logs a failed collective with its traceback: the output keeps only the warning that
    the step was not committed, naming the group that left and gloo's reason."""
    import logging

    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:945. "
            "This is typically caused by a remote worker crashing. GLHF!")
    warned = "replica group 1 failed mid-step: Connection closed by peer [127.0.0.1]:945"
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peers=(1,))
    assert _step(rg, loader, model) == ("batch1", True)
    manager.commit_answer = False
    try:  # group 1 died during the gradients' all-reduce
        raise RuntimeError(gloo)
    except RuntimeError:
        logging.getLogger("torchft.manager").exception("[torchtitan_ft_0:uuid/0 - step 1] got exception waiting for work")
    assert _step(rg, loader, model) == ("batch2", False)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [f"fault tolerance: step 2 not committed ({warned}); trying it again with the same batch"]
    rg._last_warning = -1e9  # warnings come at most every 10 s
    manager.peer_died = gloo  # now during the bookkeeping exchange
    assert _step(rg, loader, model) == ("batch2", False)
    assert caplog.records[-1].getMessage() == f"fault tolerance: step 2 not committed ({warned}); trying it again with the same batch"


def test_the_fingerprint_covers_the_options_the_groups_share(tmp_path):
    a, b = _config(tmp_path), _config(tmp_path, replica_id=1)
    assert config_fingerprint(a, 2) == config_fingerprint(b, 2)  # the replica id is each group's own
    assert config_fingerprint(a, 2) != config_fingerprint(a, 4)  # ranks per group must match
    b.optimizer.lr *= 2
    assert config_fingerprint(a, 2) != config_fingerprint(b, 2)
    mine, theirs = section_fingerprints(a, 2), section_fingerprints(b, 2)
    assert list(mine) == list(theirs) and [s for s in mine if mine[s] != theirs[s]] == ["optimizer"]
    assert [s for s, f in section_fingerprints(a, 4).items() if f != mine[s]] == ["ranks per group"]


def test_a_replica_id_used_twice_is_refused(tmp_path, monkeypatch):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peers=(0,))
    with pytest.raises(ConfigError, match=r"replica id\(s\) \[0\] are used by more than one"):
        _step(rg, loader, model)


def test_a_group_left_alone_past_the_quorum_timeout_ends_as_a_hang(tmp_path, monkeypatch):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch, peers=())
    rg.ft.min_replica_size, rg.ft.quorum_timeout_seconds = 2, 1
    manager.commit_answer = False
    monkeypatch.setattr(fault_tolerance.time, "sleep", lambda s: None)
    rg._last_commit -= 5
    with pytest.raises(Hang, match="no step committed for"):
        _step(rg, loader, model)


def test_the_live_state_restores_model_optimizer_and_schedule(tmp_path):
    config = _config(tmp_path)
    torch.manual_seed(0)
    sender = nn.Linear(4, 3)
    receiver = copy.deepcopy(sender)
    with torch.no_grad():
        receiver.weight.add_(1.0)
    opt_s, opt_r = build_optimizers([sender], config, None), build_optimizers([receiver], config, None)
    lr_s, lr_r = build_lr_schedulers(opt_s, config), build_lr_schedulers(opt_r, config)
    for _ in range(3):
        sender(torch.randn(2, 4)).sum().backward()
        opt_s.step()
        lr_s.step()
        opt_s.zero_grad()
    ts_s, ts_r = TrainState(step=3, tokens_seen=30), TrainState()
    state = copy.deepcopy(live_state(named_tensors([sender]), opt_s, lr_s, ts_s))
    load_live_state(state, named_tensors([receiver]), opt_r, lr_r, ts_r)  # receiver never stepped
    assert all(torch.equal(a, b) for a, b in zip(sender.parameters(), receiver.parameters()))
    assert lr_r.get_last_lr() == lr_s.get_last_lr() and ts_r.tokens_seen == 30
    x = torch.randn(2, 4)
    for model, opt in ((sender, opt_s), (receiver, opt_r)):
        model(x).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(sender.parameters(), receiver.parameters()))
    with pytest.raises(ConfigError, match="shard has shape"):
        bad = copy.deepcopy(state)
        bad["model"]["0.weight"] = torch.zeros(5, 4)
        load_live_state(bad, named_tensors([receiver]), opt_r, lr_r, ts_r)
    with pytest.raises(ConfigError, match="other parameters"):
        bad = copy.deepcopy(state)
        del bad["model"]["0.bias"]
        load_live_state(bad, named_tensors([receiver]), opt_r, lr_r, ts_r)


def test_no_quorum_ends_as_a_hang_naming_a_lighthouse_that_is_gone(tmp_path, monkeypatch):
    """torchft's quorum fails the same way (a gRPC status) whether the lighthouse is gone or forms no
    quorum: the line says which, by whether anything still answers at the lighthouse's address."""
    import socket

    def no_quorum():
        raise RuntimeError('status: Cancelled, message: "Timeout expired", details: []\nmore detail')

    with socket.socket() as lighthouse:  # one that answers but forms no quorum
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        rg, manager, loader, model = _groups(tmp_path, monkeypatch)
        rg.config.fault_tolerance.lighthouse = f"127.0.0.1:{lighthouse.getsockname()[1]}"
        manager.wait_quorum = no_quorum
        with pytest.raises(Hang, match="no quorum of at least 1 replica groups within 60 s.*Timeout expired.*details: \\[\\]$"):
            _step(rg, loader, model)
    rg, manager, loader, model = _groups(tmp_path, monkeypatch)  # its lighthouse, localhost:1, answers nothing
    manager.wait_quorum = no_quorum
    with pytest.raises(Hang, match=r"^fault tolerance: the lighthouse at localhost:1 is gone \(nothing answers there"):
        _step(rg, loader, model)


def test_a_torn_position_file_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "fault_tolerance"
    folder.mkdir()
    (folder / "data_rank0.pt").write_bytes(b"not a torch file")
    rg, manager, loader, model = _groups(tmp_path, monkeypatch)
    assert rg.position.previous is None and "ignoring the unreadable data position file" in caplog.text


def test_a_position_file_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    rg, manager, loader, model = _groups(tmp_path, monkeypatch)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fault_tolerance.torch, "save", disk_full)
    assert _step(rg, loader, model) == ("batch1", True)
    assert _step(rg, loader, model) == ("batch2", True)
    assert caplog.text.count("could not write the data position file") == 1


@pytest.fixture
def fsdp_tp_mesh():
    """Rank 0 of 4 on the "fake" backend (collectives do nothing): a 2 x 2 (dp_shard, tp) mesh whose
    parameters carry the placements of FSDP 2 x TP 2 inside a replica group, with no peers running."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.runtime.torch_compat.fake import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    finally:
        dist.destroy_process_group()


def _fsdp_tp_model(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 5))  # 5 rows: uneven shards
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def test_a_sharded_group_that_never_stepped_rebuilds_the_peers_optimizer_state(tmp_path, fsdp_tp_mesh):
    """A group restarted before its first checkpoint has no optimizer state: the peer's shards become
    DTensors with the parameters' mesh and placements (_StridedShard where FSDP shards a dimension TP
    already shards, uneven shards), and both groups then step alike."""
    from torch.distributed.tensor import DTensor

    config = _config(tmp_path)
    sender, receiver = _fsdp_tp_model(fsdp_tp_mesh), _fsdp_tp_model(fsdp_tp_mesh)
    opt_s, opt_r = build_optimizers([sender], config, None), build_optimizers([receiver], config, None)
    lr_s, lr_r = build_lr_schedulers(opt_s, config), build_lr_schedulers(opt_r, config)
    for step in range(2):
        for i, p in enumerate(sender.parameters()):
            p.grad = torch.full_like(p, 0.1 * (i + 1) + step)
        opt_s.step()
        lr_s.step()
    state = copy.deepcopy(live_state(named_tensors([sender]), opt_s, lr_s, TrainState(step=2)))
    load_live_state(state, named_tensors([receiver]), opt_r, lr_r, TrainState())
    strided = 0
    for ps, pr in zip(sender.parameters(), receiver.parameters()):
        sent, got = opt_s.optimizers[0].state[ps], opt_r.optimizers[0].state[pr]
        assert sent.keys() == got.keys()
        for key, value in sent.items():
            if isinstance(value, DTensor):
                assert isinstance(got[key], DTensor) and got[key].placements == value.placements
                assert (got[key].device_mesh, got[key].shape, got[key].stride()) == (value.device_mesh, value.shape,
                                                                                     value.stride())
                assert torch.equal(got[key].to_local(), value.to_local())
                strided += any(type(p).__name__ == "_StridedShard" for p in value.placements)
            else:
                assert torch.equal(got[key], value)
    assert strided, "no _StridedShard placement was exercised"
    for model, opt in ((sender, opt_s), (receiver, opt_r)):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(sender.parameters(), receiver.parameters()))
