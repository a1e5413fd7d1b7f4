"""Semi-synchronous replica groups (fault_tolerance.semi_sync_method = local_sgd | diloco).

Each group trains alone with its own optimizer for fault_tolerance.sync_steps (H) steps: no
cross-group traffic and no quorum between syncs, so groups joined by slow links wait for each
other once every H steps instead of every step. At a sync (after every step divisible by H) the
groups average how far each moved since the last sync, the drift = (parameters at the last sync,
kept here as an fp32 "backup") - (parameters now), through ReplicaGroups' bucketed all-reduce
(the same participation and configuration slots as the gradient path), and commit it:

- local_sgd: parameters = backup - average drift, the average of the groups' parameters;
- diloco (Douillard et al., 2023): the average drift is the gradient of an outer Nesterov SGD
  step on the backup: m = mu * m + g; parameters = backup - outer_lr * (g + mu * m).

A sync that is not committed (too few groups, a group failed during it) discards the H steps:
the parameters go back to the backup and the step count, token count, LR schedule and data
position to the last sync, so the same batches are trained again (the inner optimizer's moments
keep what the discarded steps added, as in torchft's DiLoCo). The ledger counts H batches per
committed sync per participating group.

A group that comes back recovers live at its first sync: it is sent the backup, DiLoCo's momentum
and the last sync's counters besides what the synchronous mode sends. Checkpoints do not hold the
outer state: a resumed group restarts it from its resumed parameters (momentum zero) and counts
syncs from there, so that a group restarted while others train on is always behind them and
recovers from them.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from torchtitan.parallelisms.fault_tolerance import ReplicaGroups
from torchtitan.parallelisms.live_state import local_shard
from torchtitan.parallelisms.replica_step import ReplicaStep

logger = logging.getLogger("torchtitan")


@torch.no_grad()
def local_sgd_update(backup: list[torch.Tensor], avg_drift: list[torch.Tensor]) -> list[torch.Tensor]:
    """The new parameters of local SGD: each group's backup less the groups' average drift. With the
    backups equal (they are after every committed sync) this is the average of the parameters."""
    return [b - d for b, d in zip(backup, avg_drift, strict=True)]


@torch.no_grad()
def nesterov_outer_update(backup: list[torch.Tensor], avg_drift: list[torch.Tensor], momentum: list[torch.Tensor],
                          lr: float, mu: float) -> list[torch.Tensor]:
    """DiLoCo's outer step: SGD with Nesterov momentum on the backup, the average drift as gradient.
    Updates `momentum` in place; returns the new parameters."""
    new = []
    for b, g, m in zip(backup, avg_drift, momentum, strict=True):
        m.mul_(mu).add_(g)
        new.append(b - lr * (g + mu * m))
    return new


class SemiSync(ReplicaStep):
    """The outer loop of local SGD / DiLoCo around one rank's parameter shards (those its optimizer
    holds), as the loop's ReplicaStep: each step's batch comes through the replica groups' data
    ledger, its gradients stay the group's own and its update is applied; `after_update(step)` syncs
    every H steps."""

    settles_every_step = True  # as ReplicaGroups: a sync commits what the steps before it applied

    def __init__(self, groups: ReplicaGroups, model_parts: list[nn.Module], lr_schedulers: Any, train_state: Any):
        ft = groups.ft
        self.groups, self.method, self.every = groups, ft.semi_sync_method, ft.sync_steps
        self.outer_lr, self.outer_momentum = ft.outer_lr, ft.outer_momentum
        self.lr_schedulers, self.train_state = lr_schedulers, train_state
        # Named now, as the optimizer holds them: FSDP swaps unsharded tensors in during forward.
        self.params = [p for part in model_parts for p in part.parameters()]
        self.backup = [local_shard(p).detach().to(torch.float32, copy=True) for p in self.params]
        self.momentum = [torch.zeros_like(b) for b in self.backup] if self.method == "diloco" else []
        self.sync_point = self._counters()
        self.committed = self.failed = self.discarded = 0
        step = train_state.step
        # Syncs are counted from this start: a group that restarts is behind any group still training.
        groups.count_syncs_from(step - step % self.every, self.every)
        if step % self.every:
            logger.warning(f"fault tolerance: resumed at step {step}, between syncs (every {self.every} steps); "
                           "checkpoints hold no outer state, so it restarts from this group's step-"
                           f"{step} parameters: resume every group from checkpoints at a sync step "
                           "(checkpoint.interval a multiple of fault_tolerance.sync_steps)")
        groups.manager.register_state_dict_fn("semi_sync", self._load_live_state, self._live_state)

    def _counters(self) -> dict[str, Any]:
        return {"step": self.train_state.step, "tokens_seen": self.train_state.tokens_seen,
                "lr_scheduler": copy.deepcopy(self.lr_schedulers.state_dict())}

    def draw(self, next_batch: Any) -> Any:
        return self.groups.draw(next_batch)

    def after_update(self, step: int) -> bool:
        """Syncs when `step` is a multiple of H; False when that sync was not committed (the trainer
        then leaves the step: the counters are back at the last sync)."""
        if step % self.every:
            return True
        groups = self.groups
        groups.start_step()
        with torch.no_grad():
            drifts = [b - local_shard(p).detach().float() for b, p in zip(self.backup, self.params)]
        groups.average_parameters_drift(drifts)
        if groups.commit():
            self._apply(drifts)
            return True
        self._discard(step)
        return False

    @torch.no_grad()
    def _apply(self, avg_drift: list[torch.Tensor]) -> None:
        if self.method == "diloco":
            new = nesterov_outer_update(self.backup, avg_drift, self.momentum, self.outer_lr, self.outer_momentum)
        else:
            new = local_sgd_update(self.backup, avg_drift)
        for b, p, n in zip(self.backup, self.params, new):
            b.copy_(n)
            local_shard(p).copy_(n)
        self.committed += 1
        self.sync_point = self._counters()
        self.groups.record_sync_point()

    @torch.no_grad()
    def _discard(self, step: int) -> None:
        """A sync not committed: back to the last sync's parameters, counters and data position."""
        for b, p in zip(self.backup, self.params):
            local_shard(p).copy_(b)
        point = self.sync_point
        lost = step - point["step"]
        self.train_state.step, self.train_state.tokens_seen = point["step"], point["tokens_seen"]
        self.lr_schedulers.load_state_dict(copy.deepcopy(point["lr_scheduler"]))
        self.groups.rewind_to_sync_point()
        self.failed += 1
        self.discarded += lost
        logger.warning(f"fault tolerance: the sync at step {step} was not committed; the {lost} steps since step "
                       f"{point['step']} are discarded and trained again on the same batches")

    def step_line(self) -> tuple[dict[str, Any], str]:
        return self.groups.step_line()

    def close(self) -> None:
        self.groups.close()

    def log_summary(self) -> None:
        self.groups.log_summary()
        logger.info(f"fault tolerance ({self.method}, sync every {self.every} steps): {self.committed} syncs committed, "
                    f"{self.failed} not committed ({self.discarded} steps' batches discarded and read again)")

    # ------------------------------------------------------------------------------------------
    # Live recovery: what a group behind is sent besides ReplicaGroups' live state

    def _live_state(self) -> dict[str, Any]:
        """References, not copies: the backup and momentum change only after this sync's commit."""
        return {"backup": self.backup, "momentum": self.momentum, "sync_point": self.sync_point,
                "step_base": self.groups.step_base}

    @torch.no_grad()
    def _load_live_state(self, state: dict[str, Any]) -> None:
        for own, received in zip(self.backup, state["backup"], strict=True):
            own.copy_(received)
        for own, received in zip(self.momentum, state["momentum"], strict=True):
            own.copy_(received)
        self.sync_point = copy.deepcopy(state["sync_point"])
        self.groups.step_base = int(state["step_base"])


def join_semi_sync(groups: ReplicaStep, model_parts: list[nn.Module], lr_schedulers: Any, train_state: Any) -> ReplicaStep:
    """The loop's ReplicaStep: with fault_tolerance.semi_sync_method local_sgd or diloco the outer loop
    around `groups`, else `groups` themselves (ReplicaGroups, or the do-nothing ReplicaStep)."""
    if not isinstance(groups, ReplicaGroups) or groups.ft.semi_sync_method == "none":
        return groups
    return SemiSync(groups, model_parts, lr_schedulers, train_state)
