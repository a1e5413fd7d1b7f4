"""The setup record: what a run applied and loaded, read from the built model, in metrics.jsonl.

Console lines say what each step applied, for people; this record says it for programs (tests,
the parity harness, tools), which must not depend on log wording. Rank 0 appends it to
metrics.jsonl once per run, right after the first step this run trains: optimizer state exists
only from then on, and the lazily initialised wrappers (DDP) are built by then. It comes before
that step's own row and carries `first_step`, so a resumed run writes its own and keeps earlier
runs' records for the steps it keeps (metrics.py). Every key is listed in docs/architecture.md.

The parallelisms are described from rank 0's model parts as built (with pipeline parallelism,
rank 0 holds the first stage; `moe` comes from the first rank that holds MoE layers); per-rank
facts (state bytes, pipeline stages, MoE layers and MTP modules held, start-up phases) are gathered
from every rank once. FSDP2, composable DDP, the pipeline schedule and torch.compile keep what is
read here only in private attributes; each such read says so.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.observability.metrics import MetricsLogger, local_state_bytes
from torchtitan.optimizers.muon import describe as describe_muon
from torchtitan.parallelisms.activation_offload import OffloadWrapper
from torchtitan.parallelisms.chunked_loss import ChunkedLossHead
from torchtitan.parallelisms.cp_attention import cp_attention
from torchtitan.parallelisms.float8 import is_float8
from torchtitan.parallelisms.lora_linear import block_part, is_adapted
from torchtitan.parallelisms.mixed_precision import autocast_dtype
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.runtime.torch_compat import composable as torch_compat_composable
from torchtitan.runtime.torch_compat import pipelining as torch_compat_pipelining

if TYPE_CHECKING:
    from torchtitan.checkpoint.resume import ResumePoint
    from torchtitan.config.job_config import JobConfig
    from torchtitan.observability.goodput import Goodput
    from torchtitan.parallelisms.pipeline_runtime import Pipeline
    from torchtitan.trainer.optimizer import OptimizersContainer


class SetupRecord:
    """What a run starts from (model, initial load, data shards), known before its first step;
    `write` adds what the built model parts show and every rank's state bytes."""

    def __init__(self, job_config: JobConfig, model_args: Any, n_params: int, resume: ResumePoint | None,
                 resumed_step: int, data_shards: int, goodput: Goodput | None = None):
        model = job_config.model
        self.first_step = resumed_step + 1
        self.goodput = goodput  # whose start-up phases each rank reports
        self.start: dict[str, Any] = {
            "model": {"name": model.name, "flavor": model.flavor, "parameters": n_params, "vocab_size": model_args.vocab_size,
                      "vocab_padding": getattr(model_args, "vocab_padding", 0)},
            # A seed or exported checkpoint (weights only) starts at step 0; a full one resumes after its step.
            "initial_load": None if resume is None else {"path": str(resume.path), "weights_only": resume.weights_only,
                                                         "step": resumed_step,
                                                         **({"format": "huggingface"} if resume.hf else {})},
            "data_shards": data_shards,
            # How the data reaches the model, as configured: workers and shuffling do not change it
            # (docs/data.md), document masking does.
            "data": {"workers": job_config.training.dataset_num_workers, "shuffle": job_config.training.dataset_shuffle,
                     "document_mask": job_config.training.document_mask},
        }

    def write(self, metrics: MetricsLogger, parallel_dims: ParallelDims, model_parts: list[nn.Module],
              optimizers: OptimizersContainer, pipeline: Pipeline | None = None) -> dict | None:
        """Collective: every rank calls it after the step `first_step`. Returns the record on rank 0."""
        facts = _rank_facts(model_parts, optimizers, pipeline)
        if self.goodput is not None:
            facts["startup_seconds"] = {k: round(v, 3) for k, v in self.goodput.startup_phases().items()}
        ranks = _gather(facts)
        if ranks is None:
            return None
        record = {"record": "setup", "first_step": self.first_step, "world_size": len(ranks),
                  "mesh": _mesh(parallel_dims.world_mesh) or {}, **self.start, "startup": _slowest_startup(ranks),
                  **describe_parallelisms(model_parts, parallel_dims, optimizers, pipeline, ranks), "ranks": ranks}
        metrics.log_record(record)
        return record


def _slowest_startup(ranks: list[dict]) -> dict[str, float]:
    """Each start-up phase's wall seconds on the slowest rank: the job waits for it at the next
    collective, so it is the phase's cost to the job (each rank's own are under `ranks`)."""
    slowest: dict[str, float] = {}
    for r in ranks:
        for phase, seconds in r.get("startup_seconds", {}).items():
            slowest[phase] = max(slowest.get(phase, 0.0), seconds)
    return slowest


def _gather(facts: dict) -> list[dict] | None:
    """Every rank's `facts` in rank order on rank 0; None on the other ranks."""
    if not dist.is_initialized():
        return [facts]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, facts)
    return gathered if dist.get_rank() == 0 else None


def _rank_facts(model_parts: list[nn.Module], optimizers: OptimizersContainer, pipeline: Pipeline | None) -> dict:
    param_bytes, state_bytes = local_state_bytes(model_parts, optimizers.optimizers)
    facts = {"rank": dist.get_rank() if dist.is_initialized() else 0, "parameter_bytes": param_bytes,
             "optimizer_state_bytes": state_bytes}
    if pipeline is not None:
        stages = torch_compat_pipelining.schedule_stages(pipeline.schedule)
        facts["pipeline_stages"] = [{"stage": s.stage_index, "blocks": _blocks(s.submod)} for s in stages]
    # Under PP rank 0 may hold no MoE layer (a dense first stage) and the MTP modules live on the
    # last stage: each rank says what it holds, so the record shows where they were applied.
    moe = _moe([(name, m) for part in model_parts for name, m in part.named_modules()])
    if moe is not None:
        facts["moe"] = moe
    if _mtp_modules(model_parts):
        facts["mtp_modules"] = _mtp_modules(model_parts)
    chunks = _loss_chunk_sizes(model_parts)
    if chunks:
        facts["loss_chunk_size"] = chunks[0]
    if any(is_adapted(m) for part in model_parts for m in part.modules()):
        facts["lora_trainable_parameters"] = _trainable(model_parts)
    return facts


def _trainable(model_parts: list[nn.Module]) -> int:
    """Elements of the parameters these parts train (global counts: a DTensor's numel is the whole's)."""
    return sum(p.numel() for part in model_parts for p in part.parameters() if p.requires_grad)


def _lora(model_parts: list[nn.Module], ranks: list[dict]) -> dict | None:
    """LoRA (lora.rank > 0): rank 0's adapted layers (by their names within a block), and the
    elements trained over the whole model (each pipeline stage's counted once)."""
    adapted = [m for part in model_parts for m in part.modules() if is_adapted(m)]
    if not adapted:
        return None
    rank = adapted[0].lora_a.weight.shape[0]
    by_stages = {tuple(s["stage"] for s in r.get("pipeline_stages", ())): r["lora_trainable_parameters"]
                 for r in ranks if "lora_trainable_parameters" in r}
    return {"rank": rank, "alpha": adapted[0].lora_scale * rank, "layers": len(adapted),
            "targets": sorted({block_part(m.lora_name) for m in adapted}),
            "trainable_parameters": sum(by_stages.values()) if by_stages else _trainable(model_parts)}


def _loss_chunk_sizes(model_parts: list[nn.Module]) -> list[int]:
    """The chunk size of each chunked-loss head in these parts (training.loss_chunk_size; a
    pipeline's last stage holds the head)."""
    return [m.chunk_size for part in model_parts for m in part.modules() if isinstance(m, ChunkedLossHead)]


def _chunked_loss(ranks: list[dict]) -> dict | None:
    holders = [r for r in ranks if r.get("loss_chunk_size")]
    return {"chunk_size": holders[0]["loss_chunk_size"], "ranks": [r["rank"] for r in holders]} if holders else None


def _mtp_modules(model_parts: list[nn.Module]) -> int:
    """Multi-token prediction modules (a model's `mtp` list, DeepSeek-V3) in these model parts."""
    return sum(len(getattr(part, "mtp", None) or ()) for part in model_parts)


def _mtp(model_parts: list[nn.Module], ranks: list[dict]) -> dict | None:
    depth = max([_mtp_modules(model_parts), *(r.get("mtp_modules", 0) for r in ranks)])
    return None if depth == 0 else {"depth": depth, "ranks": [r["rank"] for r in ranks if r.get("mtp_modules")]}


def _blocks(part: nn.Module) -> list[str]:
    """The transformer blocks of a model part by name (models keep them in `layers`)."""
    layers = getattr(part, "layers", None)
    return [f"layers.{name}" for name in layers.keys()] if isinstance(layers, nn.ModuleDict) else []


def _checkpointable_blocks(part: nn.Module) -> list[str]:
    """The blocks activation checkpointing wraps: `_blocks`, and the block of each multi-token
    prediction module (DeepSeek-V3's `mtp.{k}.block`)."""
    return _blocks(part) + [f"mtp.{k}.block" for k in range(len(getattr(part, "mtp", None) or ()))]


def _mesh(mesh) -> dict[str, int] | None:
    return None if mesh is None else dict(zip(mesh.mesh_dim_names, (int(n) for n in mesh.shape)))


def _dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def describe_parallelisms(model_parts: list[nn.Module], parallel_dims: ParallelDims, optimizers: OptimizersContainer,
                          pipeline: Pipeline | None, ranks: list[dict]) -> dict:
    """The parallelisms the model parts carry, one key each (None where not applied)."""
    modules = [(name, m) for part in model_parts for name, m in part.named_modules()]
    # FSDP units inside MoE layers shard over meshes of their own; the "moe" record lists those.
    fsdp, replicate = _data_parallel([(n, m) for n, m in modules if not _in_moe(n)])
    zero1 = getattr(optimizers, "zero1", None)
    return {
        "fsdp": fsdp,
        "ddp": replicate,
        "tp": _tensor_parallel(modules, parallel_dims),
        "cp": _context_parallel(modules, parallel_dims),
        "pipeline": _pipeline(pipeline, ranks),
        "zero1": None if zero1 is None else {"replicas": zero1.size, "parameters": len(zero1.params),
                                             "owned_parameters": sum(zero1.owns(p) for p in zero1.params)},
        "optimizer": _optimizer(optimizers),
        "muon": describe_muon(optimizers.optimizers),  # optimizer.name Muon: rank 0's matrices
        "activation_checkpoint": _activation_checkpoint(model_parts, modules),
        "compile": {"compiled_modules": sum(torch_compat_composable.compiled_call(m) is not None for _, m in modules)},
        "float8": _float8(modules, fsdp is not None),
        # Rank 0's MoE layers, or the first rank's that holds some (a dense first pipeline stage).
        "moe": _moe(modules) or next((r["moe"] for r in ranks if r.get("moe")), None),
        "mtp": _mtp(model_parts, ranks),
        # lora.rank > 0: the adapters (rank 0's layers) and the whole model's trainable elements.
        "lora": _lora(model_parts, ranks),
        # training.loss_chunk_size: the ranks whose output computes the loss chunk by chunk.
        "chunked_loss": _chunked_loss(ranks),
        # Mixed precision without FSDP (FSDP's own policy is in "fsdp"): the dtype each part autocasts to.
        "autocast": _autocast(model_parts),
    }


def _optimizer(optimizers: OptimizersContainer) -> dict:
    """Rank 0's optimizer classes and the dtypes its state is stored in (optimizer.state_dtype),
    read from the state itself; step counters (0-dim) aside."""
    dtypes = {_dtype(v.dtype) for o in optimizers.optimizers for state in o.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0}
    return {"names": sorted({type(o).__name__ for o in optimizers.optimizers}), "state_dtypes": sorted(dtypes)}


def _autocast(model_parts: list[nn.Module]) -> dict | None:
    dtypes = {_dtype(autocast_dtype(part)) for part in model_parts} - {None}
    return {"dtype": dtypes.pop(), "parts": len(model_parts)} if dtypes else None


def _data_parallel(modules: list[tuple[str, nn.Module]]) -> tuple[dict | None, dict | None]:
    """(FSDP / HSDP, replication: composable DDP or FSDP-based replicate)."""
    shard_groups, replicate_groups = [], []
    for _, m in modules:
        if isinstance(m, FSDPModule):
            for group in torch_compat_composable.fsdp_param_groups(m):
                sharded = getattr(group.mesh_info, "shard_mesh_dim", None) is not None
                (shard_groups if sharded else replicate_groups).append(group)
    fsdp = None
    if shard_groups:
        first, resharding = shard_groups[0], sum(g.post_forward_mesh_info is not None for g in shard_groups)
        n = len(shard_groups)
        fsdp = {"modules": n, "mesh": _mesh(first.mesh_info.mesh),
                "reshard_after_forward": ("always" if resharding == n else "never" if resharding == 0
                                          else f"{resharding} of {n} modules"),
                "cpu_offload": isinstance(first.offload_policy, CPUOffloadPolicy),
                "param_dtype": _dtype(first.mp_policy.param_dtype), "reduce_dtype": _dtype(first.mp_policy.reduce_dtype)}
    if replicate_groups:
        first = replicate_groups[0]
        return fsdp, {"kind": "fsdp_replicate", "modules": len(replicate_groups), "mesh": _mesh(first.mesh_info.mesh),
                      "bucket_cap_mb": None}
    for _, m in modules:
        if torch_compat_composable.replicated_by_ddp(m):
            ddp = torch_compat_composable.ddp_of(m)  # built at the first forward
            return fsdp, {"kind": "ddp", "modules": 1, "mesh": _mesh(getattr(ddp, "device_mesh", None)),
                          "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20 if ddp is not None else None}
    return fsdp, None


def _tp_placement(p: torch.Tensor):
    """The placement of a parameter on the mesh dim named "tp", or None."""
    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or ()
    return p.placements[names.index("tp")] if "tp" in names else None


def _tensor_parallel(modules: list[tuple[str, nn.Module]], parallel_dims: ParallelDims) -> dict | None:
    if parallel_dims.tp_mesh is None:
        return None
    params = {id(p): p for _, m in modules for p in m.parameters(recurse=False)}.values()
    placements = Counter(repr(pl) for p in params if (pl := _tp_placement(p)) is not None)
    # Sequence parallelism leaves its mark on the blocks' norms: their weights become DTensors
    # replicated over tp (norms without weights cannot show it). Other norms may be replicated over
    # tp in any case (Qwen3's per-head q/k norms, DeepSeek-V3's latent and MTP norms).
    norms_replicated = any(name.rsplit(".", 1)[-1] in ("attention_norm", "ffn_norm")
                           and isinstance(_tp_placement(p), Replicate)
                           for name, m in modules for p in m.parameters(recurse=False))
    return {"mesh": _mesh(parallel_dims.tp_mesh), "parameters": sum(placements.values()),
            "placements": dict(sorted(placements.items())), "sequence_parallel": norms_replicated,
            # What the training loop computes the loss under (torch's loss_parallel context).
            "loss_parallel": parallel_dims.loss_parallel_enabled,
            "float8_linears": sum(is_float8(m) and _tp_placement(m.weight) is not None for _, m in modules)}


def _context_parallel(modules: list[tuple[str, nn.Module]], parallel_dims: ParallelDims) -> dict | None:
    if parallel_dims.cp_mesh is None:
        return None
    kernels = [k for _, m in modules if isinstance(k := getattr(m, "kernel", None), functools.partial)
               and k.func is cp_attention]
    methods = sorted({k.keywords.get("method", "ring") for k in kernels})
    # "ring_attention_modules" keeps its name for records written before the all-gather method.
    return {"mesh": _mesh(parallel_dims.cp_mesh), "ring_attention_modules": len(kernels), "methods": methods}


def _pipeline(pipeline: Pipeline | None, ranks: list[dict]) -> dict | None:
    if pipeline is None:
        return None
    stages = {s["stage"]: s for r in ranks for s in r["pipeline_stages"]}  # tp / dp peers hold the same stages
    ordered = [stages[i] for i in sorted(stages)]
    name = type(pipeline.schedule).__name__
    return {
        # The runtime class itself runs a schedule loaded from a CSV file.
        "schedule": "CSV" if torch_compat_pipelining.is_csv_schedule(pipeline.schedule) else name.removeprefix("Schedule"),
        "microbatches": torch_compat_pipelining.schedule_microbatches(pipeline.schedule),
        "stages": len(ordered),
        "split_points": [s["blocks"][0] for s in ordered[1:] if s["blocks"]],
    }


def _activation_checkpoint(model_parts: list[nn.Module], modules: list[tuple[str, nn.Module]]) -> dict:
    # A checkpointed block inside an offload wrapper is recorded by the block's own name.
    offloaded = {id(torch_compat_composable.wrapped_module(m)): name for name, m in modules if isinstance(m, OffloadWrapper)}
    wrappers = [(offloaded.get(id(m), name), m) for name, m in modules
                if isinstance(m, torch_compat_composable.CheckpointWrapper)]
    return {"blocks": [b for part in model_parts for b in _checkpointable_blocks(part)],
            "wrapped": [name for name, _ in wrappers],
            # Op-level selective checkpointing passes its save policy as the checkpoint's context_fn.
            "op_level": any("context_fn" in getattr(m.checkpoint_fn, "keywords", {}) for _, m in wrappers),
            # Blocks whose saved activations go to host memory (activation_checkpoint.offload).
            "offloaded": list(offloaded.values())}


def _in_moe(name: str) -> bool:
    """Whether a module name lies inside an MoE layer (`layers.3.moe`, `layers.3.moe.experts`)."""
    return "moe" in name.split(".")


def _moe(modules: list[tuple[str, nn.Module]]) -> dict | None:
    """Mixture-of-experts layers (recognised by their per-step statistics) and where their experts
    live: the mesh of the stacked expert weights shows expert parallelism (dim `ep`) and the FSDP
    dims that shard them."""
    layers = [m for _, m in modules if hasattr(m, "take_step_stats")]
    if not layers:
        return None
    first = layers[0]
    w = first.experts.w1
    mesh = _mesh(w.device_mesh) if isinstance(w, DTensor) else None
    ep = (mesh or {}).get("ep", 1)
    fsdp_dims = {k: v for k, v in (mesh or {}).items() if k != "ep"}
    units = sorted({str(_mesh(g.mesh_info.mesh)) for n, m in modules if _in_moe(n) and isinstance(m, FSDPModule)
                    for g in torch_compat_composable.fsdp_param_groups(m)})
    return {"layers": len(layers), "experts": first.num_experts, "top_k": first.top_k,
            "ep_mesh": {"ep": ep} if ep > 1 else None, "experts_per_rank": first.num_experts // ep,
            "expert_fsdp_mesh": fsdp_dims or None, "fsdp_unit_meshes": units,
            "aux_loss_coef": first.aux_loss_coef, "bias_update_rate": first.bias_update_rate,
            "capacity_factor": first.capacity_factor}


def _float8(modules: list[tuple[str, nn.Module]], fsdp: bool) -> dict | None:
    linears = [m for _, m in modules if is_float8(m)]
    if not linears:
        return None
    # torchao wraps the weights that FSDP all-gathers in float8 in its own tensor subclass.
    gathered = any(type(_local(m.weight)).__name__ == "WeightWithDynamicFloat8CastTensor" for m in linears)
    # torchao's config of the first linear: what scales its inputs (tensorwise, or axiswise: rowwise),
    # and whether the weight gradient's matmul stays in high precision (its input not cast).
    config = linears[0].config
    scaling = "rowwise" if config.cast_config_input.scaling_granularity.value == "axiswise" else "tensorwise"
    if scaling == "rowwise" and config.cast_config_input_for_grad_weight.scaling_type.value == "disabled":
        scaling = "rowwise_with_gw_hp"
    return {"linears": len(linears), "fsdp_float8_all_gather": fsdp and gathered, "scaling": scaling}
