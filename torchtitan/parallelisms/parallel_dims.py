"""ParallelDims: the one source of truth for parallel degrees, and the world mesh built from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchtitan.config.job_config import JobConfig, Training
from torchtitan.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

# Mesh dimension order, outermost first. Pipeline stages talk least often, so pp is outermost;
# tp talks every layer, so it is innermost (ranks that are neighbours on one host).
MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views of several dims, each named for its use (see the role properties of ParallelDims).
FLATTENED_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),  # data loading: ranks that read different data
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP: ranks that share one parameter shard set
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # loss averaging
}
# Expert parallelism adds no ranks: it takes ep of the dp_shard x cp ranks (x tp: under tensor
# parallelism each tp rank routes its own slice of the tokens, so for MoE layers tp ranks are
# data-parallel ranks too). With ep > 1 the world mesh splits dp_shard into dp_shard_mod_ep
# (outer: ranks holding the same experts) x dp_shard_in_ep (inner: with cp and tp, the ep group),
# and the views above see dp_shard as those two dims. Both are kept even at size 1: the experts'
# FSDP needs a mesh in any case.
EP_DP_SHARD_DIMS = ("dp_shard_mod_ep", "dp_shard_in_ep")
# Views for mixture-of-experts layers (see the MoE role properties below).
MOE_VIEWS = {
    "ep": ("dp_shard_in_ep", "cp", "tp"),  # expert parallelism: tokens travel between these ranks
    "efsdp": ("dp_shard_mod_ep",),  # FSDP of the experts: ranks holding the same experts
    "dp_shard_cp_tp": ("dp_shard", "cp", "tp"),  # FSDP of MoE layers under TP (tp ranks route their own tokens)
    "cp_tp": ("cp", "tp"),  # ranks holding parts of the same sequences
    "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),  # ranks of one pipeline stage
}
_OPTION = {
    "dp_replicate": "training.data_parallel_replicate_degree",
    "dp_shard": "training.data_parallel_shard_degree",
    "cp": "experimental.context_parallel_degree",
    "tp": "training.tensor_parallel_degree",
    "pp": "experimental.pipeline_parallel_degree",
    "ep": "training.expert_parallel_degree",
}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = every rank left over by the other degrees
    cp: int
    tp: int
    pp: int
    world_size: int
    enable_loss_parallel: bool
    ep: int = 1  # expert parallelism: borrowed from dp_shard x cp, so not part of the product below
    # What set the world size, for the error lines: the launcher's NGPU, or a dry run's option.
    world_size_from: str = field(default="NGPU", compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        # A ParallelDims built by hand (tools, tests) passes the same rule as a config's degrees.
        check_degrees({name: getattr(self, name) for name in _OPTION})
        others = self.dp_replicate * self.cp * self.tp * self.pp
        derived = self.dp_shard == -1
        if derived:
            if self.world_size % others or self.world_size < others:
                given = [f"{_OPTION[n]} {getattr(self, n)}" for n in MESH_DIM_ORDER
                        if n != "dp_shard" and getattr(self, n) > 1]
                named = given[0] if len(given) == 1 else f"{', '.join(given)} multiply to {others}, which"
                raise ConfigError(
                    f"{named} does not divide the world size {self.world_size} "
                    f"({self.world_size_from}); "
                    f"change {'that degree' if len(given) == 1 else 'those degrees'} or the number of processes"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            degrees = " x ".join(f"{name} {getattr(self, name)}" for name in MESH_DIM_ORDER)
            raise ConfigError(
                f"parallel degrees {degrees} = {product} must equal the world size {self.world_size}; "
                f"change the degrees or the number of processes ({self.world_size_from}), or set "
                "training.data_parallel_shard_degree = -1 to use the remaining ranks"
            )
        self._validate_ep(derived)

    def _validate_ep(self, dp_shard_derived: bool = False) -> None:
        if self.ep == 1:
            return
        borrowed = self.dp_shard * self.cp * self.tp
        if self.ep % (self.cp * self.tp) or borrowed % self.ep:
            named = " x ".join(f"{n} {getattr(self, n)}" for n in ("dp_shard", "cp", "tp") if n == "dp_shard" or getattr(self, n) > 1)
            raise ConfigError(
                f"training.expert_parallel_degree {self.ep} must divide the ranks it is taken from ({named} = "
                f"{borrowed}) and be a multiple of context x tensor parallel ({self.cp * self.tp}): "
                f"{self._ep_advice(dp_shard_derived)}"
            )

    def _ep_advice(self, dp_shard_derived: bool) -> str:
        """What would work instead of an expert-parallel degree the ranks cannot hold. The model's
        expert count is not known here (the launcher's torch-free pre-check), so a smaller degree
        is offered only as a divisor of the one asked for (which divides the experts if that one
        does: the model's own rule checks it), and the degree asked for with the ranks it needs."""
        unit, ep = self.cp * self.tp, self.ep
        # Candidates up to 64 ranks each: a degree or a world of any size is answered at once.
        fitting = [d for d in range(min(ep - 1, 64), 1, -1) if ep % d == 0 and d % unit == 0
                   and (self.dp_shard * unit) % d == 0]
        options = []
        if fitting:
            options.append(f"set it to {' or '.join(map(str, fitting))} (divisors of {ep}, so they divide the experts as "
                           f"{ep} does)")
        if ep % unit == 0:
            step = ep // unit  # dp_shard must divide by it
            shard = -(-self.dp_shard // step) * step
            options.append(f"keep {ep} on {self.world_size // self.dp_shard * shard} ranks ({self.world_size_from})"
                           if dp_shard_derived else f"keep {ep} with training.data_parallel_shard_degree {shard}")
        else:
            multiples = [d for d in range(unit, min(self.dp_shard, 64) * unit + 1, unit) if (self.dp_shard * unit) % d == 0]
            options.append(f"set it to a multiple of {unit} that divides both these ranks and the model's experts "
                           f"({' or '.join(map(str, multiples))} here)")
        options.append("set it to 1 (no expert parallelism)")
        return ", ".join(options[:-1]) + f", or {options[-1]}"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Builds the named world mesh (size-1 dims left out), its FLATTENED_VIEWS and the role views.

        The meshes are kept here and handed out by role (`fsdp_mesh`, `replicate_mesh`, ...) or by
        name through `get_mesh`. A single process needs no mesh: every mesh is None.
        """
        # Imported here so that validation alone (the launcher's pre-flight check) needs no torch.
        from torch.distributed.device_mesh import init_device_mesh

        from torchtitan.runtime.torch_compat import mesh as torch_compat_mesh

        self._meshes: dict[str, DeviceMesh] = {}
        sizes = self._mesh_dim_sizes()
        names = [n for n, size in sizes.items() if size > 1 or n in EP_DP_SHARD_DIMS]
        if not names:
            return None
        shape = [sizes[n] for n in names]
        world = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        self._meshes = {"world": world, **{n: world[n] for n in names if sizes[n] > 1}}
        views = dict(FLATTENED_VIEWS, **MOE_VIEWS) if self.ep > 1 or self.tp > 1 else FLATTENED_VIEWS
        if self.ep > 1:
            views["dp_shard"] = ("dp_shard",)
        for flat_name, members in views.items():
            if self.ep > 1:  # dp_shard is two dims of the mesh
                members = tuple(d for n in members for d in (EP_DP_SHARD_DIMS if n == "dp_shard" else (n,)))
            if flat_name not in ("efsdp",):
                members = tuple(n for n in members if sizes.get(n, 1) > 1)
            present = tuple(n for n in members if n in names)
            if present and (flat_name == "efsdp" or _prod(sizes[n] for n in present) > 1):
                # Flattened meshes are kept by name here: slicing them back out of the world
                # mesh is deprecated in PyTorch.
                self._meshes[flat_name] = torch_compat_mesh.flatten(world[present], flat_name)
        if self.fsdp_enabled and self.dp_replicate_enabled:
            self._meshes["hsdp"] = _join(world, self._meshes["dp_replicate"], self._meshes["dp_shard_cp"])
        logger.info(f"built world mesh {dict(zip(names, shape))} on {device_type}")
        return world

    def _mesh_dim_sizes(self) -> dict[str, int]:
        """The world mesh's dims, outermost first, with their sizes (size-1 dims included)."""
        sizes = {n: getattr(self, n) for n in MESH_DIM_ORDER}
        if self.ep > 1:
            in_ep = self.ep // (self.cp * self.tp)
            split = {"dp_shard_mod_ep": self.dp_shard // in_ep, "dp_shard_in_ep": in_ep}
            sizes = {d: v for n, size in sizes.items() for d, v in (split.items() if n == "dp_shard" else ((n, size),))}
        return sizes

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """The world mesh, one of its dims, or a view by name; None when of size 1 (except
        `efsdp`, which exists whenever ep > 1)."""
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before get_mesh()")
        known = ("world", "hsdp", "ehsdp", *MESH_DIM_ORDER, *FLATTENED_VIEWS, *MOE_VIEWS, *EP_DP_SHARD_DIMS)
        if name not in meshes and name not in known:
            raise KeyError(f"unknown mesh name {name!r}")
        return meshes.get(name)

    # Meshes by role. Every parallelize function asks for a role, so the choice of which mesh dims
    # form which group is made here, once, for every model family.

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """What FSDP shards parameters over: `dp_shard x cp` (context-parallel peers hold different
        tokens, so they reduce gradients like data-parallel ranks and may share one parameter
        shard set). With replicas as well it is HSDP's 2-D (dp_replicate, dp_shard_cp) mesh:
        replicated over the outer dim, sharded over the inner. None without FSDP."""
        if not self.fsdp_enabled:
            return None
        return self.get_mesh("hsdp") if self.dp_replicate_enabled else self.get_mesh("dp_shard_cp")

    @property
    def replicate_mesh(self) -> DeviceMesh | None:
        """Ranks holding full replicas of the same parameters: DDP's group, HSDP's outer dim and
        the group ZeRO-1 spreads optimizer state over."""
        return self.get_mesh("dp_replicate")

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """Ranks whose losses are averaged into the step's loss: every rank that holds different
        tokens (dp_replicate x dp_shard x cp)."""
        return self.get_mesh("dp_cp")

    @property
    def data_mesh(self) -> DeviceMesh | None:
        """Ranks that read different data (dp_replicate x dp_shard); tp, cp and pp peers read the
        same batches."""
        return self.get_mesh("dp")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.get_mesh("tp")

    # Mixture-of-experts roles. Under TP each tp rank routes its own slice of the tokens, so MoE
    # parameters are data-parallel over tp as well: their FSDP meshes include tp (and their
    # gradients are divided by the data-parallel size alone, `moe_gradient_divide_factor`).

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """Ranks that split the experts and exchange tokens (ep of the dp_shard x cp x tp ranks)."""
        return self.get_mesh("ep") if self.ep > 1 else None

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """What FSDP shards an ep-sharded expert weight over: the ranks holding the same experts
        (dp_shard x cp x tp / ep of them), HSDP's 2-D mesh with replicas. Exists (maybe of size 1)
        whenever ep > 1, so the experts are always their own FSDP unit."""
        if self.ep == 1:
            return None
        if self.dp_replicate_enabled:
            if "ehsdp" not in self._meshes:
                self._meshes["ehsdp"] = _join(self.world_mesh, self._meshes["dp_replicate"], self._meshes["efsdp"])
            return self._meshes["ehsdp"]
        return self.get_mesh("efsdp")

    @property
    def moe_fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP mesh of the MoE layers' other parameters (router; experts without EP) under TP:
        the dp_shard x cp x tp ranks, HSDP's 2-D mesh with replicas. None without TP: they then
        shard with their block over `fsdp_mesh`."""
        if self.tp == 1:
            return None
        inner = self.get_mesh("dp_shard_cp_tp")
        if self.dp_replicate_enabled:
            if "moe_hsdp" not in self._meshes:
                self._meshes["moe_hsdp"] = _join(self.world_mesh, self._meshes["dp_replicate"], inner)
            return self._meshes["moe_hsdp"]
        return inner

    @property
    def sequence_mesh(self) -> DeviceMesh | None:
        """Ranks holding parts of the same sequences inside an MoE layer (cp x tp)."""
        return self.get_mesh("cp_tp") if self.tp > 1 else self.get_mesh("cp")

    @property
    def stage_mesh(self) -> DeviceMesh | None:
        """Every rank of one pipeline stage (all dims but pp): where routed-token counts are summed."""
        return self.get_mesh("dp_cp_tp") if self.tp > 1 else self.get_mesh("dp_cp")

    @property
    def moe_gradient_divide_factor(self) -> int:
        """Ranks whose losses are averaged (dp_replicate x dp_shard x cp): what MoE gradients,
        summed over more ranks than that (tp, or the ep group through the all-to-all), are divided by."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.get_mesh("cp")

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.get_mesh("pp")

    @property
    def world_mesh(self) -> DeviceMesh | None:
        return self.get_mesh("world")

    def data_parallel_coordinates(self) -> tuple[int, int]:
        """(this rank's index among the ranks that read different data, their number)."""
        mesh = self.data_mesh
        return (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        """Replicated data parallelism without sharding (FSDP takes over replicas when it shards)."""
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def wraps_data_parallel(self) -> bool:
        """The model is wrapped by FSDP/HSDP or DDP, which reduce gradients across ranks and can
        skip that reduction (gradient accumulation)."""
        return self.fsdp_enabled or self.ddp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp > 1 and self.enable_loss_parallel

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that work on the same tokens (tp x cp x pp), e.g. to count tokens per device."""
        return self.tp * self.cp * self.pp

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks that each read different data."""
        return self.dp_replicate * self.dp_shard


def _config_degrees(job_config: JobConfig) -> dict[str, int]:
    """The configured degree of each mesh dim (and ep), as _OPTION names them."""
    return {name: getattr(getattr(job_config, option.split(".")[0]), option.split(".")[1])
            for name, option in _OPTION.items()}


def check_degrees(degrees: dict[str, int]) -> None:
    """Every degree is >= 1; dp_shard may also be -1 (the ranks the others leave)."""
    for name, value in degrees.items():
        if value < 1 and not (name == "dp_shard" and value == -1):
            raise ConfigError(f"{_OPTION[name]} must be >= 1{' or -1' if name == 'dp_shard' else ''}, got {value}")


def check_degree_options(config: JobConfig) -> None:
    """The options phase's degree rule (the world size is not known yet)."""
    check_degrees(_config_degrees(config))


def parallel_dims_from_config(job_config: JobConfig, world_size: int) -> ParallelDims:
    training = job_config.training
    return ParallelDims(
        **_config_degrees(job_config),
        world_size=world_size,
        enable_loss_parallel=training.enable_loss_parallel and not training.disable_loss_parallel,
        world_size_from="job.dry_run_world_size" if job_config.job.dry_run and job_config.job.dry_run_world_size else "NGPU",
    )


def check_options(config: JobConfig) -> None:
    """What the degrees ask of other options, checked before the world size is known."""
    training, experimental = config.training, config.experimental
    if experimental.enable_async_tensor_parallel:
        if training.tensor_parallel_degree == 1:
            raise ConfigError("experimental.enable_async_tensor_parallel needs training.tensor_parallel_degree > 1")
        if not training.compile:
            raise ConfigError("experimental.enable_async_tensor_parallel works through torch.compile's micro-pipelining; "
                              "set training.compile true")
    if experimental.context_parallel_degree > 1 and experimental.context_parallel_backend == "torch":
        raise ConfigError("experimental.context_parallel_backend 'torch' (PyTorch's context parallel) is not offered "
                          "yet: it has no CPU path, and this version runs only the ring backend; use 'ring'")


def check_sequence_split(config: JobConfig, dims: ParallelDims) -> None:
    """CP gives each rank two equal chunks of every sequence, and sequence parallelism (TP's
    default) splits a rank's positions evenly over the tp ranks; an uneven split would fail deep in
    the first forward (RoPE's rows, or a gloo size mismatch). A layout rule, checked once the
    degrees are known to fit the world size: a degree that does not is the mistake to name."""
    training, cp, tp = config.training, dims.cp, dims.tp
    if cp > 1 and training.seq_len % (2 * cp):
        raise ConfigError(f"training.seq_len {training.seq_len} must divide by 2 x experimental.context_parallel_degree "
                          f"= {2 * cp}: each cp rank holds two equal chunks of every sequence")
    if tp == 1 or training.disable_sequence_parallel:
        return
    local = training.seq_len // cp  # with cp > 1, divisible by 2 x cp (above)
    if local % tp:
        per_rank = f" / experimental.context_parallel_degree {cp} = {local}" if cp > 1 else ""
        raise ConfigError(f"training.seq_len {training.seq_len}{per_rank} must divide by training.tensor_parallel_degree "
                          f"{tp}: sequence parallelism splits each sequence's positions evenly over the tp ranks; "
                          "choose such a seq_len, or set training.disable_sequence_parallel")


def check_layout(config: JobConfig, dims: ParallelDims) -> None:
    """What a layout of the known world size can honour."""
    _check_fsdp_only_options(config.training, dims)
    if config.training.defer_sharded_gradient_reduction and dims.pp_enabled:
        raise ConfigError("training.defer_sharded_gradient_reduction cannot hold under pipeline parallelism: PyTorch's "
                          "pipeline stage reduces FSDP's gradients at the end of every schedule step; leave it off")
    if config.checkpoint.create_seed_checkpoint and dims.world_size > 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process; got {dims.world_size} (set NGPU=1)")


def _check_fsdp_only_options(training: Training, dims: ParallelDims) -> None:
    """Options that only FSDP/HSDP can honour are refused, not ignored, on layouts without it."""
    if dims.fsdp_enabled:
        return
    if dims.ddp_enabled:
        layout = (f"training.data_parallel_replicate_degree {dims.dp_replicate} with shard degree 1 is DDP, "
                  "which has no sharding")
    else:
        layout = "this layout has no FSDP (data_parallel_shard_degree 1)"
    if training.enable_cpu_offload:
        raise ConfigError(
            f"training.enable_cpu_offload offloads FSDP-sharded state and needs data_parallel_shard_degree > 1; {layout}"
        )
    if training.fsdp_reshard_after_forward != "default":
        raise ConfigError(f"training.fsdp_reshard_after_forward {training.fsdp_reshard_after_forward!r} applies to FSDP only; "
                          f"{layout}; leave it at 'default'")
    if training.defer_sharded_gradient_reduction:
        raise ConfigError(f"training.defer_sharded_gradient_reduction defers FSDP's reduce-scatter; {layout}, whose "
                          "gradients are whole and reduced on the last micro-step anyway; leave it off")
    if training.mixed_precision_reduce == "bfloat16" and not dims.ddp_enabled:
        raise ConfigError(f"training.mixed_precision_reduce bfloat16 has no effect on one rank: {layout}; leave it at float32")


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def _join(world: DeviceMesh, outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The 2-D mesh (outer, inner) of two 1-D views of `world`, reusing their process groups."""
    from torchtitan.runtime.torch_compat import mesh as torch_compat_mesh

    return torch_compat_mesh.join(world, outer, inner)
