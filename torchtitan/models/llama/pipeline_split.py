"""Where Llama's pipeline stages start: given split points, or a cost-balanced split.

Used by `validate_llama` (before any process group exists, so an impossible split is one line)
and by `pipeline_llama` (which cuts the stages there), from the one PipelinePlan of the job.
"""

from __future__ import annotations

from torchtitan.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.parallelisms.pipeline_decoder import parse_split_points, stage_starts  # noqa: F401


def unit_costs(args: ModelArgs, seq_len: int) -> list[float]:
    """Estimated training cost of each transformer block, in FLOPs per token (the matmuls of the
    block plus its attention scores), with the output projection added to the last block (it runs
    on the last stage) and the embedding lookup, which costs memory but almost no compute, counted
    by its parameters on the first."""
    head_dim = args.dim // args.n_heads
    kv_dim = (args.n_kv_heads or args.n_heads) * head_dim
    block_params = args.dim * (2 * args.dim + 2 * kv_dim) + 3 * args.dim * ffn_hidden_dim(args)
    block = 6.0 * block_params + 12.0 * args.n_heads * head_dim * seq_len
    vocab = args.vocab_size + args.vocab_padding
    costs = [block] * args.n_layers
    costs[-1] += 6.0 * vocab * args.dim
    costs[0] += vocab * args.dim / seq_len  # the embedding's weight update, spread over the tokens
    return costs


def split_points_for(args: ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    """The block index where each stage after the first starts: as configured, or cost-balanced."""
    return stage_starts(args.n_layers, unit_costs(args, job_config.training.seq_len), job_config, plan)
