"""Parallelism for mixture-of-experts layers (torchtitan/models/moe.py), for any model family.

Expert parallelism (EP): each of the `ep` ranks of `ParallelDims.ep_mesh` owns E / ep experts. The
MoE layer hands its experts the tokens sorted by expert; `apply_expert_parallel` wraps the experts
module so that those tokens travel to the ranks owning their experts and back, by two all-to-alls
(PyTorch's autograd-aware functional collective, on gloo and NCCL alike), and shards the stacked
weights by expert (DTensor `Shard(0)`, so checkpoints keep whole-model names and shapes and load
under any ep). The MoE layer's arithmetic is unchanged: each token meets the same experts with
the same weights, only on another rank.

Tensor parallelism (`moe_tp_plan`): an MoE layer takes the tokens of its own rank's sequence
slice (sequence-parallel layout) and routes them itself, so MoE parameters are data-parallel over
tp as well as dp x cp: their FSDP units (`moe_fsdp_units`) shard over meshes that include tp and
divide gradients by the data-parallel size alone. Expert weights are not split by TP.

In the dropping mode (`moe.capacity_factor`) the layer hands over a padded layout, every expert
the same Python-int number of rows: each rank then sends E / ep x rows to every rank, equal splits
known without exchanging counts, and the received rows are regrouped by a fixed reshape
(`_dispatch_static`). Nothing is read to the host.

The dry run, whose fake tensors hold no counts to exchange, replaces the exchange of counts
(`exchange_counts`, kept on the experts module) with an even spread (torchtitan/estimation).

`configure_moe` sets the layer's seams: the per-sequence count sum over cp x tp ranks, and the
number of sequences per step, which keep the load-balancing loss the same under every layout; and
the dropping mode's capacity factor.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.observability import host_reads
from torchtitan.parallelisms.data_parallel import FSDPUnit
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline import PipelinePlan
from torchtitan.runtime.torch_compat import collectives as torch_compat_collectives

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Token dispatch


class _Dispatch:
    """What the combine needs from the dispatch of one forward (kept on the experts module
    between its pre- and post-forward hooks). `order` None: the dropping mode's padded layout,
    `rows` per expert and source rank."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], order: torch.Tensor | None, rows: int = 0):
        self.send_splits, self.recv_splits, self.order, self.rows = send_splits, recv_splits, order, rows


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Sends each token (sorted by global expert) to the rank owning its expert; returns the
    tokens this rank's experts compute, sorted by local expert, and their counts."""
    tokens, counts = inputs
    if isinstance(counts, int):
        return _dispatch_static(module, tokens, counts, mesh)
    ep = mesh.size()
    group = mesh.get_group()
    local_experts = counts.numel() // ep
    send_counts = counts.view(ep, local_experts)  # row r: tokens for rank r's experts
    recv_counts, send_splits, recv_splits = module.exchange_counts(send_counts, tokens, group)
    received = torch_compat_collectives.all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
    received = torch_compat_collectives.wait(received)
    # Received tokens come grouped by source rank, then expert; the experts want them by expert.
    segment = torch.repeat_interleave(torch.arange(ep * local_experts, device=tokens.device), recv_counts.flatten(),
                                      output_size=sum(recv_splits))
    by_expert = (segment % local_experts) * ep + segment // local_experts
    order = torch.argsort(by_expert, stable=True)
    module._ep_dispatch = _Dispatch(send_splits, recv_splits, order)
    return received[order], recv_counts.sum(dim=0)


def _dispatch_static(module: nn.Module, tokens: torch.Tensor, rows: int, mesh: DeviceMesh) -> tuple[torch.Tensor, int]:
    """The dropping mode's dispatch: `tokens` (E * rows, dim), `rows` per global expert. Every
    rank sends the same number of rows to every rank (the same batch and capacity everywhere), so
    the splits are Python ints and no counts are exchanged. Returns (E_local * ep * rows, dim):
    per local expert, the rows of every source rank in rank order."""
    ep = mesh.size()
    dim = tokens.shape[-1]
    local_experts = tokens.shape[0] // (rows * ep)
    splits = [local_experts * rows] * ep
    received = torch_compat_collectives.all_to_all_single_autograd(tokens, splits, splits, mesh.get_group())
    received = torch_compat_collectives.wait(received)
    module._ep_dispatch = _Dispatch(splits, splits, None, rows)
    # Arrived as (source rank, local expert, row); the experts want (local expert, source rank, row).
    by_expert = received.view(ep, local_experts, rows, dim).transpose(0, 1).reshape(-1, dim)
    return by_expert, ep * rows


def exchange_counts(send_counts: torch.Tensor, tokens: torch.Tensor,
                    group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int], list[int]]:
    """Tells every rank how many tokens it receives for each of its experts. `send_counts` (ep,
    local experts): row r, this rank's tokens for rank r's experts. Returns recv_counts (ep, local
    experts; [s, e]: tokens rank s sends to this rank's expert e) and the tokens sent to and
    received from each rank."""
    recv_counts = torch_compat_collectives.all_to_all_single(send_counts.flatten(), None, None, group).wait()
    recv_counts = recv_counts.view(send_counts.shape)
    # Both split lists in one read to the host: the dropless dispatch's only one (docs/performance.md).
    send_splits, recv_splits = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
    return recv_counts, send_splits, recv_splits


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Returns each computed token to the rank (and position) it came from."""
    d: _Dispatch = module._ep_dispatch
    module._ep_dispatch = None
    if d.order is None:  # the padded layout: back to (destination rank, local expert, row)
        ep, dim = len(d.send_splits), output.shape[-1]
        unsorted = output.view(-1, ep, d.rows, dim).transpose(0, 1).reshape(-1, dim)
    else:
        unsorted = torch.empty_like(output)
        unsorted[d.order] = output
    back = torch_compat_collectives.all_to_all_single_autograd(unsorted, d.send_splits, d.recv_splits, mesh.get_group())
    return torch_compat_collectives.wait(back)


def _to_local(weight: DTensor) -> torch.Tensor:
    """The experts' `local` seam under EP: this rank's experts of a stacked weight. A method call on
    the DTensor, which torch.compile traces (the unbound `DTensor.to_local` it skips)."""
    return weight.to_local()


def apply_expert_parallel(layers: Sequence[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Shards the experts of `layers` (MoE layers, torchtitan/models/moe.py) over `ep_mesh` and
    routes tokens to them (module docstring)."""

    def shard_by_expert(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    for layer in layers:
        layer.experts.exchange_counts = exchange_counts  # a seam: the dry run's spreads tokens evenly
        layer.experts.local = _to_local
        distribute_module(layer.experts, ep_mesh, shard_by_expert,
                          input_fn=lambda mod, inputs, mesh: _dispatch(mod, inputs, mesh),
                          output_fn=lambda mod, output, mesh: _combine(mod, output, mesh))
    if layers:
        n = layers[0].num_experts
        logger.info(f"applied expert parallelism over mesh {{'ep': {ep_mesh.size()}}}: {n // ep_mesh.size()} of {n} "
                    f"experts per rank in each of {len(layers)} MoE layers, tokens exchanged by all-to-all")


# ---------------------------------------------------------------------------------------------
# Tensor parallelism and FSDP units


def moe_tp_plan(sequence_parallel: bool) -> PrepareModuleInputOutput:
    """The TP style of an MoE layer: it computes its rank's slice of the sequence (already the
    layout under sequence parallelism; sliced from the replicated input, then gathered, without)."""
    outside = Shard(1) if sequence_parallel else Replicate()
    return PrepareModuleInputOutput(input_layouts=(outside,), desired_input_layouts=(Shard(1),), use_local_input=True,
                                    output_layouts=(Shard(1),), desired_output_layouts=(outside,),
                                    use_local_output=True)


def moe_fsdp_units(layers: Sequence[nn.Module], parallel_dims: ParallelDims) -> list[FSDPUnit]:
    """The MoE parts whose parameters are shared by other ranks than the block's: the experts
    under EP (held by the ranks with the same experts, `expert_fsdp_mesh`), and under TP the whole
    layer (router, and experts without EP; data-parallel over dp x cp x tp, `moe_fsdp_mesh`)."""
    units = []
    factor = parallel_dims.moe_gradient_divide_factor
    for layer in layers:
        if parallel_dims.ep > 1:
            units.append(FSDPUnit(layer.experts, parallel_dims.expert_fsdp_mesh, factor))
        if parallel_dims.tp > 1:
            units.append(FSDPUnit(layer, parallel_dims.moe_fsdp_mesh, factor))
    return units


# ---------------------------------------------------------------------------------------------
# What an MoE model needs of the layout


def check_moe_layout(num_experts: int, parallel_dims: ParallelDims, plan: PipelinePlan | None,
                     job_config: JobConfig, flavor: str) -> None:
    """The layout rules of any model with MoE layers, for its family's ValidateFn (one line each).
    (A dense flavor with ep > 1 is refused by preflight's `experts` rule, for every family.)"""
    ep, tp, cp = parallel_dims.ep, parallel_dims.tp, parallel_dims.cp
    if ep > 1 and num_experts % ep:
        borrowed = parallel_dims.dp_shard * cp * tp  # the ranks EP is taken from (parallel_dims.py)
        fits = [d for d in range(borrowed, 1, -1) if borrowed % d == 0 and num_experts % d == 0 and d % (cp * tp) == 0]
        both = f"both the {num_experts} experts and the {borrowed} ranks it is taken from"
        raise ConfigError(f"training.expert_parallel_degree {ep} must divide the {num_experts} experts of {flavor}: "
                          + (f"set it to {' or '.join(map(str, fits))} (dividing {both}), or to 1 (no expert parallelism)"
                             if fits else f"no degree above 1 divides {both}; set it to 1 (no expert parallelism)"))
    if ep > 1 or tp > 1:
        # The MoE layers then have FSDP units of their own inside each block.
        ac = job_config.activation_checkpoint
        if ac.mode == "selective" and ac.selective_ac_option == "op":
            raise ConfigError("activation_checkpoint.selective_ac_option 'op' cannot checkpoint MoE layers that expert or "
                              "tensor parallelism shards on their own (their FSDP gathers run inside the checkpointed "
                              "region and differ in the recompute); use activation_checkpoint.mode full, or selective "
                              "with a block interval")
    if tp == 1:
        return
    if plan is not None and plan.split_backward:
        raise ConfigError(f"experimental.pipeline_parallel_schedule {plan.schedule} computes weight gradients in a "
                          "second backward pass, which cannot reach the MoE layers' parameters under "
                          "training.tensor_parallel_degree > 1 (PyTorch 2.13); use a schedule without zero bubble "
                          "(1F1B, Interleaved1F1B, ...)")
    if parallel_dims.ddp_enabled:
        raise ConfigError(f"an MoE model under training.tensor_parallel_degree {tp} shards its MoE layers over the tp "
                          "ranks with FSDP, which DDP replicas (training.data_parallel_replicate_degree "
                          f"{parallel_dims.dp_replicate} with training.data_parallel_shard_degree 1) cannot hold; "
                          "shard instead (training.data_parallel_shard_degree > 1)")
    local = job_config.training.seq_len // cp
    if local % tp:
        raise ConfigError(f"an MoE model under training.tensor_parallel_degree {tp} routes each tp rank's slice of "
                          f"the sequence: training.seq_len {job_config.training.seq_len} / "
                          f"experimental.context_parallel_degree {cp} = {local} tokens must divide by {tp}")


def moe_compiles_whole(parallel_dims: ParallelDims) -> bool:
    """Whether `training.compile` can take a block with an MoE layer whole, in one graph
    (fullgraph): when the layer's parts are no FSDP units of their own (`moe_fsdp_units`: none
    without EP and TP). Then both modes compile: the dropping mode's shapes are fixed, and dropless
    keeps its counts on the device up to the expert matmul (one opaque operator,
    torchtitan/models/expert_loop_op.py). Otherwise the routed experts stay eager: FSDP's hooks on a
    module inside a compiled block are excluded from the graph (PyTorch 2.13), whatever the mode;
    dropless EP also sizes its all-to-alls from counts read to the host; and under TP a checkpoint
    wraps the compiled block (tensor_parallel.apply_ac_and_compile), whose re-run in backward a
    compiled layer could not tell from a forward, counting its routing statistics twice. What of
    such a layer compiles on its own in the dropping mode is `compile_moe_parts`'."""
    return not parallel_dims.tp_enabled and parallel_dims.ep == 1


def compile_moe_parts(layer: nn.Module, parallel_dims: ParallelDims) -> bool:
    """Compiles the parts of an MoE layer whose block cannot take it whole (`moe_compiles_whole`
    False), where their shapes are fixed: in the dropping mode (`capacity_factor` > 0) under EP
    without TP, each in one graph (fullgraph): the router, the placement into the padded buffer
    (`MoE.capacity_place`), the experts (their FSDP unit's hooks stay outside the graph, as a
    block's; EP's all-to-alls of equal splits, fixed by the batch and the capacity, inside) and the
    read-back (`MoE.capacity_combine`). The layer's forward around them stays eager: it counts the
    routing statistics once, also when a checkpoint re-runs the block in backward. Dropless keeps
    the layer eager: its dispatch sizes the all-to-alls from counts read to the host, which a graph
    cannot hold. Under TP (where the dropping mode is refused) nothing. Returns whether it compiled."""
    if not (layer.capacity_factor > 0 and parallel_dims.ep > 1 and not parallel_dims.tp_enabled):
        return False
    layer.router.compile(fullgraph=True)
    layer.experts.compile(fullgraph=True)
    # Methods, not modules: compiled as the layer's own attributes (its state and names unchanged).
    layer.capacity_place = torch.compile(layer.capacity_place, fullgraph=True)
    layer.capacity_combine = torch.compile(layer.capacity_combine, fullgraph=True)
    return True


# ---------------------------------------------------------------------------------------------
# Seams


def configure_moe(layers: Sequence[nn.Module], parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Sets the seams of MoE `layers` (torchtitan/models/moe.py) for this layout and batch."""
    training = job_config.training
    group = parallel_dims.sequence_mesh if parallel_dims.tp * parallel_dims.cp > 1 else None

    def sum_over_sequence_group(counts: torch.Tensor) -> torch.Tensor:
        reduced = torch_compat_collectives.all_reduce(counts, "sum", group)
        return torch_compat_collectives.wait(reduced)

    for layer in layers:
        if group is not None:
            layer.sum_over_sequence_group = sum_over_sequence_group
        layer.sequence_group_size = parallel_dims.cp * parallel_dims.tp
        layer.aux_loss_rank_weight = parallel_dims.cp
        layer.sequences_per_step = training.batch_size * training.gradient_accumulation_steps
        layer.experts.use_grouped_mm = None if job_config.moe.grouped_mm else False
        layer.capacity_factor = job_config.moe.capacity_factor


# ---------------------------------------------------------------------------------------------
# After each optimizer step


def _layer_index(name: str) -> int:
    """The block index in an MoE layer's module name (`layers.3.moe`, under any wrapper); a
    multi-token prediction module's block (`mtp.0.block.moe`, DeepSeek-V3) counts as -1 - depth."""
    parts = name.split(".")
    if "layers" not in parts and "mtp" in parts:
        return -1 - int(parts[parts.index("mtp") + 1])
    return int(parts[parts.index("layers") + 1])


def _layer_label(index: int, sep: str = "") -> str:
    """`layer3` / `mtp0` in metric names; with `sep` " ", `layer 3` / `mtp 0` on the console."""
    return f"layer{sep}{index}" if index >= 0 else f"mtp{sep}{-1 - index}"


def moe_after_step(model_parts: list[nn.Module], parallel_dims: ParallelDims, *,
                   log: bool) -> tuple[dict[str, float], str] | None:
    """A TrainSpec AfterStepFn for MoE models: sums the step's routed-token counts and auxiliary
    losses over the pipeline stage's ranks (one all-reduce for every layer), moves the experts'
    routing biases (auxiliary-loss-free balancing), and on logging steps reports, per layer, the
    most and the mean tokens per expert, the (token, choice) pairs the dropping mode dropped (when
    on) and, summed over layers, the auxiliary loss (a StepReport-shaped (values, summary) pair;
    gathered over pipeline stages)."""
    layers = sorted(((_layer_index(name), m) for part in model_parts for name, m in part.named_modules()
                     if hasattr(m, "take_step_stats")), key=lambda item: item[0])
    if not layers and not parallel_dims.pp_enabled:
        return None
    stats = [m.take_step_stats() for _, m in layers]
    # One row per layer: the expert counts, then the auxiliary loss, then the dropped pairs.
    per_layer = torch.stack([torch.cat([counts, aux.view(1), dropped.view(1)]) for counts, aux, dropped in stats]
                            ) if stats else None
    stage = parallel_dims.stage_mesh
    if per_layer is not None and stage is not None:
        per_layer = torch_compat_collectives.all_reduce(per_layer, "sum", stage)
        per_layer = torch_compat_collectives.wait(per_layer)
    for (_, layer), row in zip(layers, per_layer if per_layer is not None else []):
        layer.update_expert_bias(row[:-2])
    if not log:
        return None
    with host_reads.scheduled_read():  # a logging step's reads (the audit's steady state leaves them out)
        return _logged_report(layers, per_layer, parallel_dims)


def _logged_report(layers: list, per_layer: torch.Tensor | None,
                   parallel_dims: ParallelDims) -> tuple[dict[str, float], str] | None:
    """`moe_after_step`'s report on a logging step, from the per-layer rows summed over the stage."""
    # Each rank's auxiliary loss is its share of a mean over the dp x cp ranks (tp ranks hold disjoint parts).
    n_dp = parallel_dims.moe_gradient_divide_factor
    # (max, mean, aux, dropped or None when dropless, routed pairs) per layer
    mine = {i: (row[:-2].max().item(), row[:-2].mean().item(), row[-2].item() / n_dp,
                row[-1].item() if layer.capacity_factor > 0 else None, row[:-2].sum().item())
            for (i, layer), row in zip(layers, per_layer if per_layer is not None else [])}
    if parallel_dims.pp_enabled:
        gathered: list[dict] = [None] * parallel_dims.pp
        torch.distributed.all_gather_object(gathered, mine, group=parallel_dims.pp_mesh.get_group())
        mine = {i: v for d in gathered for i, v in d.items()}
    if not mine:
        return None
    values = {"moe_aux_loss": sum(aux for _, _, aux, _, _ in mine.values())}
    for i, (most, mean, _, dropped, _) in sorted(mine.items()):
        values[f"moe_max_tokens_per_expert/{_layer_label(i)}"] = most
        values[f"moe_mean_tokens_per_expert/{_layer_label(i)}"] = mean
        if dropped is not None:
            values[f"moe_dropped_tokens/{_layer_label(i)}"] = dropped
    worst = max(mine, key=lambda i: mine[i][0] / max(mine[i][1], 1e-9))
    ratio = mine[worst][0] / max(mine[worst][1], 1e-9)
    summary = f"aux: {values['moe_aux_loss']:.4f}  experts max/mean: {ratio:.2f} ({_layer_label(worst, sep=' ')})"
    capacity = [(dropped, routed) for _, _, _, dropped, routed in mine.values() if dropped is not None]
    if capacity:
        share = sum(d for d, _ in capacity) / max(sum(r for _, r in capacity), 1.0)
        summary += f"  dropped: {100 * share:.2f}%"
    return values, summary
