"""Where Llama's pipeline stages start: given split points, or a cost-balanced split.

Used by `validate_llama` (before any process group exists, so an impossible split is one line)
and by `pipeline_llama` (which cuts the stages there), from the one PipelinePlan of the job.
"""

from __future__ import annotations

from torchtitan.errors import ConfigError
from torchtitan.job_config import JobConfig
from torchtitan.models.llama.model import ModelArgs, ffn_hidden_dim
from torchtitan.parallelisms.pipeline import PipelinePlan, balanced_split


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


def parse_split_points(points: list[str], n_layers: int) -> list[int]:
    """`layers.N` names -> block indices where stages 2, 3, ... start, checked for order and range."""
    starts = []
    for point in points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdecimal() or not 0 < int(index) < n_layers:
            raise ConfigError(f"experimental.pipeline_parallel_split_points: {point!r} is not a block where a stage "
                              f"can start; use layers.1 ... layers.{n_layers - 1}")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ConfigError(f"experimental.pipeline_parallel_split_points must be increasing and distinct, got {points}")
    return starts


def split_points_for(args: ModelArgs, job_config: JobConfig, plan: PipelinePlan) -> list[int]:
    """The block index where each stage after the first starts: as configured, or cost-balanced."""
    points = job_config.experimental.pipeline_parallel_split_points
    if points:
        starts = parse_split_points(points, args.n_layers)
        if len(starts) != plan.num_stages - 1:
            raise ConfigError(f"experimental.pipeline_parallel_split_points gives {len(starts) + 1} stages, but "
                              f"{plan.pp} ranks x {plan.stages_per_rank} stages per rank need {plan.num_stages}")
        return starts
    if plan.num_stages > args.n_layers:
        raise ConfigError(f"{plan.num_stages} pipeline stages need at least as many transformer blocks; the model has "
                          f"{args.n_layers}")
    return balanced_split(unit_costs(args, job_config.training.seq_len), plan.num_stages)
