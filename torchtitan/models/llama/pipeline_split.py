"""Where Llama's pipeline stages start: given split points, or a cost-balanced split.

Used by `validate_llama` (before any process group exists, so an impossible split is one line)
and by `pipeline_llama` (which cuts the stages there), from the one PipelinePlan of the job.
"""

from __future__ import annotations

from torchtitan.config.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, block_flops
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import decoder_unit_costs, parse_split_points, stage_starts  # noqa: F401


def unit_costs(args: ModelArgs, seq_len: int) -> list[float]:
    """Estimated training cost of each transformer block (pipeline_decoder.decoder_unit_costs)."""
    return decoder_unit_costs(block_flops(args, seq_len), args.n_layers, args.vocab_size + args.vocab_padding,
                              args.dim, seq_len)


def split_points_for(args: ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    """The block index where each stage after the first starts: as configured, or cost-balanced."""
    return stage_starts(args.n_layers, unit_costs(args, job_config.training.seq_len), job_config, plan)
