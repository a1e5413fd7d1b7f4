"""Where a replica group's data shard stands, kept so that the group can continue it after a live
recovery (parallelisms/fault_tolerance.py, docs/fault_tolerance.md "The data position").

The ledger the groups share counts, per group, the batches committed steps took from that group's
shard. A group that restarts and recovers from a peer learns its own count from the peer's ledger;
the position for that count comes from this rank's position file, written before each batch is
used with the position before and after it (so a restart finds either), or, in the
semi-synchronous modes, from the position recorded at the newest committed sync. A count names the
same position in this process's files and in those of the run before a restart, as both count
batches of the same shard.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

logger = logging.getLogger("torchtitan")


class ShardPosition:
    """This rank's data position (`data_state`: its state_dict / load_state_dict), the batches
    `drawn` from its shard, and the files that keep both across a restart."""

    def __init__(self, data_state: Any, folder: str, group_rank: int, replica_id: int):
        self.data_state, self.replica_id = data_state, replica_id
        self.file = os.path.join(folder, "fault_tolerance", f"data_rank{group_rank}.pt")
        self.sync_file = os.path.join(folder, "fault_tolerance", f"data_rank{group_rank}_sync.pt")
        # From before a restart, used at a recovery: the newest batch's positions, and the data
        # position at the newest committed sync (semi-synchronous modes).
        self.previous, self.previous_sync = self._read(self.file), self._read(self.sync_file)
        self.drawn = 0  # batches taken from the shard: those the ledger counts, or one more
        self._sync_point: dict[str, Any] | None = None  # where a discarded sync goes back to
        self._unwritten = False  # the newest position file could not be written

    def next(self, next_batch: Callable[[], Any]) -> Any:
        """The next batch, its position before and after recorded first (so a restart knows both)."""
        before = self.data_state.state_dict()
        batch = next_batch()
        self.drawn += 1
        self._write(before, self.data_state.state_dict())
        return batch

    def record_sync_point(self) -> None:
        """After a committed sync: the position a later sync that is not committed goes back to, also
        kept in a file for a recovery after a restart."""
        position = self.data_state.state_dict()
        self._sync_point = {"drawn": self.drawn, "position": position}
        os.makedirs(os.path.dirname(self.sync_file), exist_ok=True)
        partial = self.sync_file + ".partial"
        torch.save({"drawn": self.drawn, "before": position, "after": position}, partial)
        os.replace(partial, self.sync_file)

    def rewind_to_sync_point(self) -> None:
        """After a sync that was not committed: the batches drawn since the last sync are read again."""
        self.data_state.load_state_dict(self._sync_point["position"])
        self.drawn = self._sync_point["drawn"]

    def move_to(self, want: int, at_syncs: bool) -> bool:
        """After a recovery: continue the shard after the `want` batches the ledger counts. False (and
        a warning) when no record has that position: the data continues from where it is."""
        record = self._read(self.file)
        # The semi-synchronous modes' counts are at syncs, which the sync records name.
        synced = self._read(self.sync_file) if at_syncs else None
        found = False
        for candidate in (record, synced, self.previous, self.previous_sync):
            if candidate is not None and candidate["drawn"] in (want, want + 1):
                self.data_state.load_state_dict(candidate["after" if candidate["drawn"] == want else "before"])
                found = True
                break
        if not found:
            have = record["drawn"] if record is not None else None
            logger.warning(f"fault tolerance: replica group {self.replica_id} has no data position for batch {want} "
                           f"of its shard (position file: {have}); it continues from its checkpoint's position, "
                           "so some of its batches are read again or skipped")
        self.drawn = want
        self.previous = self.previous_sync = None
        if at_syncs:
            self.record_sync_point()
        return found

    def _write(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        partial = self.file + ".partial"
        try:
            os.makedirs(os.path.dirname(self.file), exist_ok=True)
            torch.save({"drawn": self.drawn, "before": before, "after": after}, partial)
            os.replace(partial, self.file)
        except OSError as e:  # a full or failing disk must not stop training; only a later recovery needs it
            if not self._unwritten:
                logger.warning(f"fault tolerance: could not write the data position file {self.file} ({e}); "
                               "training goes on, but if this group recovers from a peer before a write succeeds, "
                               "its shard may be read again or skipped (the summary would say so)")
            self._unwritten = True
            return
        self._unwritten = False

    @staticmethod
    def _read(path: str) -> dict[str, Any] | None:
        try:
            return torch.load(path, weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a torn or foreign file is reported, not fatal
            logger.warning(f"fault tolerance: ignoring the unreadable data position file {path} ({e})")
            return None
