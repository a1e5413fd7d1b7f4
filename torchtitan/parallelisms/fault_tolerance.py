"""Training that survives a failed replica group (fault_tolerance.*, docs/fault_tolerance.md).

The job is several replica groups, each its own torchrun job with the usual FSDP/TP/PP layout
inside. torchft joins them: a lighthouse decides each step's quorum of live groups, a
reconfigurable process group links rank r of every group, and torchft's Manager commits a step
only when the group's ranks agree and enough groups took part. A group that dies leaves the
others stepping with fewer replicas in the average; a group that comes back is sent the live
model, optimizer, schedule and step from a peer (torchft's checkpoint transport) instead of
reading a checkpoint.

What crosses the groups each step is, first, a few bookkeeping numbers, summed on the quorum's
process group over every group in the quorum (a group recovering this step included):

- one-hot slots of the groups taking part in the average and of the groups present: every group
  learns who contributed, which keeps each group's data position exact (the ledger below), and a
  replica id used twice shows;
- a fingerprint per section of the configuration the groups must share, so groups launched with
  different options all stop with one line, naming the sections that differ, instead of averaging
  unrelated models;

then this rank's local gradient shards (or, in the semi-synchronous modes, its parameter shards'
drift since the last sync) in flat fp32 buckets, averaged through torchft's manager.

The ledger counts, per group, the batches the committed steps consumed from that group's data
shard. A group that restarts learns its own count from the peer's ledger and takes its data
position from its position files (shard_position.py), so its shard is neither read twice nor
skipped. A step that is not committed keeps its batch and trains it again.

The loop meets the groups through ReplicaStep (replica_step.py), which ReplicaGroups implements for
the groups that average every step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.config.sections import lighthouse_address
from torchtitan.errors import ConfigError, Hang, UserError
from torchtitan.parallelisms.live_state import live_state, load_live_state, local_shard, named_tensors
from torchtitan.parallelisms.replica_step import ReplicaStep
from torchtitan.parallelisms.shard_position import ShardPosition
from torchtitan.parallelisms.torchft_messages import TorchftLog, lighthouse_answers

logger = logging.getLogger("torchtitan")

# Options that may differ between groups: each group's own identity and outputs.
PER_GROUP_OPTIONS = {("fault_tolerance", "replica_id"), ("job", "dump_folder"), ("job", "description"),
                     ("job", "print_args"), ("metrics", "enable_tensorboard"), ("metrics", "log_freq"),
                     ("comm", "trace_buf_size")}
_FINGERPRINT_CHUNKS = 3  # 10-bit pieces of the configuration hash (and their squares), summed exactly
_BUFFER_BYTES = 256 * 2**20  # gradients cross the groups in buckets of at most this many bytes


RANKS_PER_GROUP = "ranks per group"


def _shared_options(config: JobConfig, group_size: int) -> dict[str, Any]:
    """Every option the groups must share (all but PER_GROUP_OPTIONS) by section, and the group's
    rank count (rank r of every group must hold the same shards)."""
    shared: dict[str, Any] = {section: {k: v for k, v in values.items() if (section, k) not in PER_GROUP_OPTIONS}
                              for section, values in sorted(config.to_dict().items())}
    shared[RANKS_PER_GROUP] = group_size
    return shared


def _hash30(value: Any) -> int:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:4], "big") & (2**30 - 1)


def config_fingerprint(config: JobConfig, group_size: int) -> int:
    """A 30-bit hash of every option the groups must share and of the group's rank count."""
    return _hash30(_shared_options(config, group_size))


def section_fingerprints(config: JobConfig, group_size: int) -> dict[str, int]:
    """config_fingerprint by section (the same sections, in the same order, in every group of one
    version), so that groups started differently are told where they differ."""
    return {section: _hash30(values) for section, values in _shared_options(config, group_size).items()}


def _fingerprint_slots(fingerprints: list[int]) -> list[float]:
    """Each fingerprint as 10-bit pieces and their squares: summed over the groups, equal sums of
    both mean every group's piece equals this group's."""
    slots = []
    for fingerprint in fingerprints:
        chunks = [(fingerprint >> (10 * i)) & 1023 for i in range(_FINGERPRINT_CHUNKS)]
        slots += [float(c) for c in chunks] + [float(c * c) for c in chunks]
    return slots


@dataclass
class Ledger:
    """Batches each group's data shard gave to committed steps (one entry per group), and what this
    group's runs did: steps committed, attempts not committed, recoveries from a peer."""

    consumed: list[int]
    committed: int = 0
    retried: int = 0
    healed: int = 0
    data_gaps: int = 0  # recoveries that found no data position for the ledger's count (see the log)
    participants: list[int] = field(default_factory=list)  # per committed step of this run (for metrics)


class ReplicaGroups(ReplicaStep):
    """This rank's side of the fault-tolerant job: the torchft Manager, the cross-group average,
    the commit, the ledger and the live state a recovering group is sent.

    As the loop's ReplicaStep (fault-tolerant HSDP), every step: `start_step()` before the batch is
    drawn, `draw(next)` for the batch, `average_gradients(params)` after backward, `commit()`, whose
    answer says whether to apply the step. The semi-synchronous modes (SemiSync, semi_sync.py) call
    `start_step`, `average_parameters_drift` and `commit` once every fault_tolerance.sync_steps steps
    instead, after `count_syncs_from`: the manager's step then counts syncs, each committing
    sync_steps batches per participating group."""

    settles_every_step = True  # a step committed across groups is not applied before it is known finite

    def __init__(self, config: JobConfig, group_rank: int, group_size: int, device: torch.device,
                 model_parts: list[nn.Module], optimizers: Any, lr_schedulers: Any, train_state: Any,
                 data_state: Any):
        # torchft's Rust side logs every quorum and commit at INFO; its warnings and errors still show.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # torchft logs a failed collective or recovery with its traceback; the step is then not committed,
        # and the warning that says so carries the failure's first line instead (_not_committed).
        self._torchft_log = TorchftLog.install()
        # torchft reads the peer's state from a read-only buffer and never writes to it, and unpickles it
        # with a pytree check PyTorch has deprecated: neither is the user's to act on.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchft\.")
        ft = config.fault_tolerance
        self.config, self.ft, self.device = config, ft, device
        self.replica_id, self.groups = ft.replica_id, ft.group_size
        self.group_rank = group_rank
        # The ledger's counts are the train state's list itself, so that checkpoints hold them.
        self.ledger = Ledger(consumed=train_state.data_consumed)
        self._train_state = train_state
        self.fingerprint = config_fingerprint(config, group_size)
        self.sections = section_fingerprints(config, group_size)
        # The parameters as the optimizer holds them (FSDP's shards), named now: during forward FSDP
        # swaps unsharded tensors into the modules, and torchft reads the state in its own thread.
        named = named_tensors(model_parts)
        self._state_fn = lambda: live_state(named, optimizers, lr_schedulers, train_state)
        self._load_fn = lambda state: load_live_state(state, named, optimizers, lr_schedulers, train_state)
        self.position = ShardPosition(data_state, config.job.dump_folder, group_rank, self.replica_id)
        self.position.drawn = self.ledger.consumed[self.replica_id]
        # Train steps per committed manager step, and the train step the manager's count starts at:
        # 1 and 0, except in the semi-synchronous modes (count_syncs_from).
        self.steps_per_commit, self.step_base = 1, 0
        self._held: Any = None  # the batch of an attempt that was not committed, trained again
        self._healed_now = False
        self._participation: list[float] | None = None
        self._present: list[int] = []  # the groups in the newest bookkeeping exchange (named when one fails)
        self._last_commit, self._last_warning = time.monotonic(), -math.inf
        self.manager = self._connect(group_rank, group_size)
        self.manager.register_state_dict_fn("torchtitan", self._load_live_state, self._live_state)

    # ------------------------------------------------------------------------------------------
    # Start-up

    def _connect(self, group_rank: int, group_size: int) -> Any:
        """torchft's Manager for this rank: the group's rank 0 runs its manager server, which
        announces the group to the lighthouse."""
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo

        ft = self.ft
        store = self._group_store(group_size)
        address = lighthouse_address(self.config)
        timeout = timedelta(seconds=ft.timeout_seconds)
        # The live state travels over the cross-group process group itself, on the interface gloo
        # uses (GLOO_SOCKET_IFNAME): torchft's default HTTP transport names this host by
        # socket.gethostname(), which other hosts may not resolve to it.
        pg = self._pg = ProcessGroupGloo(timeout=timeout)
        transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
        try:
            return Manager(
                pg=pg, checkpoint_transport=transport, load_state_dict=None, state_dict=None,
                min_replica_size=ft.min_replica_size, use_async_quorum=True, timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds), connect_timeout=timeout,
                rank=group_rank, world_size=group_size, store_addr=store[0], store_port=store[1],
                lighthouse_addr=f"http://{address}", replica_id=f"torchtitan_ft_{self.replica_id}",
                hostname=_advertised_host(), init_sync=False)
        except Exception as e:  # noqa: BLE001 - torchft raises RuntimeError with a gRPC message
            why = str(e).splitlines()[0].split(";")[0][:160]
            raise UserError(f"fault_tolerance: could not reach the lighthouse at {address} within "
                            f"{ft.timeout_seconds} s ({why}); start one with "
                            f"`torchft_lighthouse --min_replicas {ft.min_replica_size}` or FT_LIGHTHOUSE=start "
                            "(docs/fault_tolerance.md)") from None

    def _group_store(self, group_size: int) -> tuple[str, int]:
        """A TCP store of this group's own, new for every start: torchft's manager server announces
        itself there, and the groups' cross-group process group meets in the store of the group
        that leads the quorum. torchrun's store would outlive a restart of the group (MAX_RESTARTS)
        and hand the new ranks the dead manager's address. Rank 0 opens it; its address is one the
        other ranks and groups reach (LOCAL_ADDR / TORCHFT_HOSTNAME on clusters)."""
        if group_rank_zero := (not dist.is_initialized() or dist.get_rank() == 0):
            self._own_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        where = [(_advertised_host(), self._own_store.port) if group_rank_zero else None]
        if group_size > 1:
            dist.broadcast_object_list(where, src=0)
        return where[0]

    def resume_at(self, step: int) -> None:
        """After the checkpoint load (which restored the ledger): the manager counts steps from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.position.drawn = self.ledger.consumed[self.replica_id]

    def count_syncs_from(self, base: int, every: int) -> None:
        """Semi-synchronous modes: the manager counts syncs (of `every` steps each) from train step
        `base`, from zero at every start, so a restarted group is behind any group that trained on
        and recovers from it. Batches are not held: each inner step draws a new one."""
        self.steps_per_commit, self.step_base = every, base
        self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        self.position.drawn = self.ledger.consumed[self.replica_id] + self._train_state.step - base
        # Where this start stands, for a recovery at the first sync (the file before a restart was read).
        self.record_sync_point()

    def record_sync_point(self) -> None:
        """After a committed sync: the data position a later sync that is not committed goes back to."""
        self.position.record_sync_point()

    def rewind_to_sync_point(self) -> None:
        """After a sync that was not committed: the batches drawn since the last sync are read again."""
        self.position.rewind_to_sync_point()
        self._held = None

    # ------------------------------------------------------------------------------------------
    # One step

    def start_step(self) -> None:
        """Asks the lighthouse for this step's quorum; answered in the background during forward."""
        self._healed_now = False
        self.manager.start_quorum()

    def draw(self, next_batch: Callable[[], Any]) -> Any:
        """The step's batch: the one an attempt that was not committed left, else the next one, its
        position before and after recorded first (so a restart knows both)."""
        if self._held is not None:
            return self._held
        batch = self.position.next(next_batch)
        # Semi-synchronous modes hold no batch: a sync not committed rewinds the data instead.
        self._held = batch if self.steps_per_commit == 1 else None
        return batch

    def average_gradients(self, params: list[nn.Parameter]) -> None:
        """Averages this rank's local gradient shards with rank `group_rank` of every group in the
        quorum (a group that is recovering contributes zeros and is not counted)."""
        grads = [p.grad for p in params if p.grad is not None]
        self._participation = self._allreduce([local_shard(g) for g in grads])

    def average_parameters_drift(self, drifts: list[torch.Tensor]) -> None:
        """The semi-synchronous modes' sync: averages the drifts (local tensors), in place."""
        self._participation = self._allreduce(drifts)

    def commit(self) -> bool:
        """Whether the step is applied: this group's ranks agree and enough groups took part. Updates
        the ledger; after a recovery this step, moves the data position to the ledger's."""
        self._wait_quorum()
        committed = self.manager.should_commit()
        participation = self._participation or [0.0] * self.groups
        self._participation = None
        if committed:
            # The manager's count: the peers' after a recovery this step.
            self._train_state.step = self.step_base + self.manager.current_step() * self.steps_per_commit
            self.ledger.committed += 1
            self.ledger.participants.append(int(sum(participation)))
            for g, took_part in enumerate(participation):
                self.ledger.consumed[g] += int(took_part) * self.steps_per_commit
            if participation[self.replica_id]:
                self._held = None
        else:
            self.ledger.retried += 1
            self._not_committed()
        if committed:
            self._last_commit = time.monotonic()
        if self._healed_now:
            self._move_data_to_ledger()
        return committed

    def _not_committed(self) -> None:
        """A step that was not committed is tried again with the same batch; a group left without
        enough peers for longer than the quorum timeout ends as a hang would, naming why."""
        now = time.monotonic()
        n, needed = self.manager.num_participants(), self.ft.min_replica_size
        waited = now - self._last_commit
        if n < needed and waited > self.ft.quorum_timeout_seconds:
            raise Hang(f"fault tolerance: no step committed for {waited:.0f} s: {n} replica group(s) in the quorum, "
                       f"fault_tolerance.min_replica_size is {needed} (fault_tolerance.quorum_timeout_seconds "
                       f"{self.ft.quorum_timeout_seconds})")
        failure = self._torchft_log.take()
        if now - self._last_warning > 10:
            self._last_warning = now
            why = f"{n} of at least {needed} replica groups in the quorum" if n < needed else self._who_failed(failure)
            logger.warning(f"fault tolerance: step {self.manager.current_step() + 1} not committed ({why}); "
                           "trying it again with the same batch")
        if n < needed:
            time.sleep(0.5)  # the lighthouse needs time to see peers come back; do not spin on the same batch

    def _who_failed(self, failure: str | None) -> str:
        others = [g for g in self._present if g != self.replica_id]
        who = (f"replica group {others[0]}" if len(others) == 1 else
               f"one of replica groups {', '.join(map(str, others))}" if others else "a replica group")
        return f"{who} failed mid-step" + (f": {failure}" if failure else "")

    def _wait_quorum(self) -> None:
        try:
            self.manager.wait_quorum()
        except Exception as e:  # noqa: BLE001 - torchft raises the lighthouse's timeout as RuntimeError
            address = lighthouse_address(self.config)
            if not lighthouse_answers(address):
                raise Hang(f"fault tolerance: the lighthouse at {address} is gone (nothing answers there any more), so "
                           "no replica group can form a quorum; start it again and relaunch the groups, or run it "
                           "apart from any group's launcher (docs/fault_tolerance.md)") from None
            raise Hang(f"fault tolerance: no quorum of at least {self.ft.min_replica_size} replica groups within "
                       f"{self.ft.quorum_timeout_seconds} s (fault_tolerance.quorum_timeout_seconds; lighthouse "
                       f"{address}): {str(e).splitlines()[0][:200]}") from None

    def participating(self) -> int:
        """The groups that took part in the newest committed step."""
        return self.ledger.participants[-1] if self.ledger.participants else 0

    def step_line(self) -> tuple[dict[str, Any], str]:
        return {"replicas": self.participating()}, f"replicas: {self.participating()}/{self.groups}"

    def log_summary(self) -> None:
        ledger = self.ledger
        fewer = sum(1 for n in ledger.participants if n < self.groups)
        unit = "steps" if self.steps_per_commit == 1 else f"syncs of {self.steps_per_commit} steps"
        logger.info(f"fault tolerance: {ledger.committed} {unit} committed by replica group {self.replica_id}, "
                    f"{fewer} of them with fewer than {self.groups} groups; {_count(ledger.retried, 'attempt')} not "
                    f"committed (retried with the same batch); {_count(ledger.healed, 'live recovery', 'live recoveries')}; batches per group's shard: "
                    f"{ledger.consumed}" + (f"; {ledger.data_gaps} recoveries without the data position (batches of this "
                                            "group's shard read again or skipped)" if ledger.data_gaps else ""))

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------------------------------
    # The cross-group all-reduce

    def _allreduce(self, tensors: list[torch.Tensor]) -> list[float]:
        """Averages `tensors` (local, in place) over the quorum in fp32 buckets; returns which groups
        took part. First a few bookkeeping numbers travel alone (_exchange), checked before buffers
        whose sizes depend on the layout."""
        self._wait_quorum()
        summed = self._exchange()
        if summed is None:
            return [0.0] * self.groups  # the step will not be committed; nothing to check
        groups = self.groups
        participation, present = summed[:groups], summed[groups:2 * groups]
        self._present = [g for g, n in enumerate(present) if n]
        if max(present) > 1:
            twice = [g for g, n in enumerate(present) if n > 1]
            raise ConfigError(f"fault_tolerance: replica id(s) {twice} are used by more than one running group; give "
                              "each group its own fault_tolerance.replica_id")
        differ = self._differing_sections(summed[2 * groups:], sum(present))
        if differ:
            where = ", ".join("the ranks per group" if s == RANKS_PER_GROUP else f"[{s}]" for s in differ)
            raise ConfigError(f"fault_tolerance: the replica groups were started with different configurations "
                              f"(they differ in {where}); every option but fault_tolerance.replica_id and the "
                              "group's own outputs (job.dump_folder, metrics) must match, and so must the ranks per "
                              "group (NGPU x NNODES); compare their config files, command lines and launches")
        buckets, current, size = [], [], 0
        for t in tensors:
            if current and size + t.numel() * 4 > _BUFFER_BYTES:
                buckets.append(current)
                current, size = [], 0
            current.append(t)
            size += t.numel() * 4
        flats = [torch.cat([t.reshape(-1).to(torch.float32) for t in bucket]) for bucket in buckets + [current] if bucket]
        works = [self.manager.allreduce(flat) for flat in flats]
        for work in works:
            work.wait()
        if self.manager.errored() is not None:
            return [0.0] * self.groups
        for bucket, flat in zip([b for b in buckets + [current] if b], flats):
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return participation

    def _exchange(self) -> list[float] | None:
        """Sums, over every group in the quorum, one-hot slots of the groups taking part in the average,
        of the groups present (a group recovering this step is present but contributes nothing), and the
        configuration fingerprints; None when it failed (the step is then not committed). It runs on the
        quorum's process group itself, not through the manager's all-reduce, which zeroes a recovering
        group's numbers: a group recovering from a peer with another configuration must stop, and so
        must that peer."""
        if self.manager.errored() is not None:
            return None
        groups = self.groups
        slots = _fingerprint_slots(list(self.sections.values()))
        tail = torch.zeros(2 * groups + len(slots), dtype=torch.float64)
        tail[self.replica_id] = float(self.manager.is_participating())
        tail[groups + self.replica_id] = 1.0
        tail[2 * groups:] = torch.tensor(slots, dtype=torch.float64)
        try:
            self._pg.allreduce([tail], dist.ReduceOp.SUM).wait()
        except Exception as e:  # noqa: BLE001 - a peer that died mid-step: gloo's RuntimeError
            self._torchft_log.failed(str(e))
            self.manager.report_error(e)
            return None
        return tail.round().tolist()

    def _differing_sections(self, sums: list[float], count: float) -> list[str]:
        """The sections whose summed slots are not `count` times this group's: some group has
        another value there."""
        per = 2 * _FINGERPRINT_CHUNKS
        return [section for i, (section, fingerprint) in enumerate(self.sections.items())
                if any(abs(s - count * m) >= 0.5 for s, m in zip(sums[i * per:(i + 1) * per],
                                                                 _fingerprint_slots([fingerprint])))]

    # ------------------------------------------------------------------------------------------
    # Live recovery

    def _live_state(self) -> dict[str, Any]:
        """What a recovering peer is sent: this rank's shards as plain tensors (the peer's rank has
        the same layout) and the step's counters. Called by torchft in the quorum thread."""
        state = self._state_fn()
        state["ledger"] = {"consumed": list(self.ledger.consumed)}
        state["fingerprint"] = self.fingerprint
        return state

    def _load_live_state(self, state: dict[str, Any]) -> None:
        """Called by torchft in should_commit when this group was behind: takes the peer's state."""
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError("fault_tolerance: the replica group this one recovers from was started with "
                              "another configuration; every option but fault_tolerance.replica_id and the "
                              "group's outputs must match")
        started = time.perf_counter()
        self._load_fn(state)
        self.ledger.consumed[:] = [int(c) for c in state["ledger"]["consumed"]]
        self.ledger.healed += 1
        self._healed_now = True
        # The semi-synchronous modes' manager counts syncs (count_syncs_from).
        at = f"step {self.manager.current_step()}" if self.steps_per_commit == 1 else \
            f"sync {self.manager.current_step()} of its peers' run"
        logger.warning(f"fault tolerance: replica group {self.replica_id} recovered live from a peer at {at} "
                       f"({time.perf_counter() - started:.2f} s to apply)")

    def _move_data_to_ledger(self) -> None:
        """After a recovery: continue this group's shard after the batches the ledger says the
        committed steps took from it."""
        if not self.position.move_to(self.ledger.consumed[self.replica_id], at_syncs=self.steps_per_commit > 1):
            self.ledger.data_gaps += 1
        self._held = None


def _advertised_host() -> str:
    """The name the lighthouse gives peers to reach this group's manager server and state."""
    return os.environ.get("TORCHFT_HOSTNAME") or os.environ.get("LOCAL_ADDR") or socket.gethostname()


def join_replica_groups(config: JobConfig, model_parts: list[nn.Module], optimizers: Any, lr_schedulers: Any,
                        train_state: Any, dataloader: Any, device: torch.device) -> ReplicaStep:
    """This rank's ReplicaGroups after the checkpoint load; without fault tolerance the do-nothing ReplicaStep."""
    if not config.fault_tolerance.enable:
        return ReplicaStep()
    from torchtitan.checkpoint.states import DataState

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = ReplicaGroups(config, rank, world, device, model_parts, optimizers, lr_schedulers, train_state,
                           DataState(dataloader))
    groups.resume_at(train_state.step)
    logger.info(f"fault tolerance: replica group {config.fault_tolerance.replica_id} of "
                f"{config.fault_tolerance.group_size}, lighthouse {lighthouse_address(config)}, at least "
                f"{config.fault_tolerance.min_replica_size} per step")
    return groups


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
