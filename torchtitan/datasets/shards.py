"""Which data shards each data-parallel rank reads, decided once per run.

The data is cut into `count` data shards (byte or token ranges, chunks.py); rank r of
`dp_degree` data-parallel ranks reads `count // dp_degree` consecutive ones and takes an equal
slice of its batch from each. Two runs
with the same count and global batch therefore see identical data whatever their data-parallel
degree. The count is `training.dataset_shards` (-1: one per data-parallel rank), or the count a
resumed checkpoint's data position refers to. The decision is a value handed to the data loader
and the checkpoint manager, never written back into the config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataShards:
    dp_rank: int
    dp_degree: int
    count: int

    @property
    def owned(self) -> list[int]:
        """The shards this rank reads."""
        per_rank = self.count // self.dp_degree
        return list(range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank))


def decide_data_shards(configured: int, dp_rank: int, dp_degree: int, resumed: int | None = None) -> DataShards:
    """`configured` is training.dataset_shards; `resumed` the count a resumed checkpoint's data
    position refers to (ResumePoint.data_shards), which wins because any other count would not
    match the saved position."""
    if resumed is not None:
        if configured == -1 and resumed != dp_degree:
            logger.info(f"reading the data as {resumed} shards, as the checkpoint does ({resumed // dp_degree} per "
                        "data-parallel rank)")
        return DataShards(dp_rank, dp_degree, resumed)
    count = dp_degree if configured == -1 else configured
    _check_count(count, dp_degree)
    return DataShards(dp_rank, dp_degree, count)


def _check_count(count: int, dp_degree: int) -> None:
    if count % dp_degree:
        raise ConfigError(f"training.dataset_shards {count} must be a multiple of the data-parallel degree {dp_degree} "
                           "(training.data_parallel_replicate_degree x data_parallel_shard_degree)")


def check_layout(config: JobConfig, dims: ParallelDims) -> None:
    """The launcher's pre-check of the count against the layout (a resumed run must ask for the
    count its checkpoint holds anyway, so this refuses nothing a resume could use)."""
    if config.training.dataset_shards != -1:
        _check_count(config.training.dataset_shards, dims.dp_replicate * dims.dp_shard)
