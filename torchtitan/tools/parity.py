"""Parity harness: proves that a parallel layout trains exactly like one process.

Every comparison starts from one seed checkpoint (written by a single process), feeds the same
global batch in the same order (`training.dataset_shards`), runs deterministic fp32 kernels on
the CPU, and compares the per-step losses and the final gradient norm with a single-process
baseline. A layout is a name, a process count and a list of overrides; the harness derives the
per-rank batch size from the layout's data-parallel degree and gradient-accumulation steps, so
the global batch never changes.

A user tool: scripts/loss_compare.py runs it for any layout, prints a table and can plot the
loss curves. The test suite's layout matrix (tests/machinery/layout_matrix.py) and the parity
tests (tests/integration/test_parity.py) use it too. Runs go through a `Runner` (runs.py): real
processes, torchrun for several ranks, unless the caller passes another (the tests' warm one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torchtitan.config.manager import parse_args
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config
from torchtitan.tools.runs import Runner, read_metrics, read_setup, read_validations, run_trainer

# The job a comparison starts from unless the caller gives another (`base_args`): the debug model
# (8 blocks) on short sequences, real text and tokenizer, a few seconds per run on a CPU.
DEBUG_RUN = (
    "--job.config_file", "bundled:train_configs/debug_model.toml",  # found from any working directory
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
)
# What every run of a comparison shares, on top of the base arguments. The baseline uses library defaults
# for everything else (no AC, no compile), and a layout's overrides come last, so they win. Every
# run validates too (a held-out batch every 3 steps and at the last), so each layout's validation
# losses are compared as well, and a layout whose validation disturbs training shows in its losses.
COMPARISON_ARGS = ("--training.deterministic", "--activation_checkpoint.mode", "none", "--validation.enabled",
                   "--validation.freq", "3", "--validation.steps", "1", "--validation.held_out_fraction", "0.05")


@dataclass(frozen=True)
class Check:
    """A test on one value of the setup record, where equality with a value does not say enough."""

    text: str  # what the value must be, in the words a failure shows
    test: Callable[[Any], bool]

    def __call__(self, value: Any) -> bool:
        return bool(self.test(value))

    def __repr__(self) -> str:
        return self.text


# (dotted key of the setup record, the value it must equal or a Check it must pass), e.g.
# ("fsdp.mesh", {"dp_shard_cp": 2}). Setup records: torchtitan/observability/setup_record.py.
Expectations = tuple[tuple[str, Any], ...]
_ABSENT = object()


def lookup(record: dict, key: str) -> Any:
    """The value at dotted `key` of `record`, or _ABSENT."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def unmet(record: dict, expect: Expectations) -> list[str]:
    """One line per expectation the setup record does not meet."""
    failures = []
    for key, want in expect:
        got = lookup(record, key)
        if got is _ABSENT or not (want(got) if isinstance(want, Check) else got == want):
            failures.append(f"{key} should be {want!r}, the run recorded "
                            f"{'nothing' if got is _ABSENT else repr(got)}")
    return failures


@dataclass(frozen=True)
class Layout:
    """One parallel layout under test: `nproc` ranks with `overrides` on top of the shared args.

    `expect` says what the run's setup record must show, proving the layout was really applied (a
    typo in an override must not pass as a trivially equal single-process run). `shared` overrides change
    the model itself (vocabulary padding, for example): the seed checkpoint and the baseline are
    made with them too, so the layout is compared with a single process of the same model.
    `loss_tolerance` and `grad_norm_rtol`, when set, replace the harness's for this layout (float8
    and bf16 only; see there).
    """

    name: str
    nproc: int
    overrides: tuple[str, ...]
    expect: Expectations = ()
    shared: tuple[str, ...] = ()
    loss_tolerance: float | None = None
    grad_norm_rtol: float | None = None


def L(name: str, nproc: int, overrides: str, expect: dict[str, Any] | None = None, shared: str = "",  # noqa: N802 - a table row
      loss_tolerance: float | None = None, grad_norm_rtol: float | None = None) -> Layout:
    return Layout(name, nproc, tuple(overrides.split()), tuple((expect or {}).items()), tuple(shared.split()),
                  loss_tolerance, grad_norm_rtol)


# The tolerances of an fp32 layout against one process. The two differ only in the order of their
# sums (sharded matmuls, gradient reductions), and the sums are long: a token's loss in the debug
# model goes through about 18,000 additions (8 blocks), so the deterministic bound (n eps x the
# loss, 1.6e-2) says nothing. Their roundings fall either way, though: a token's loss moves by about
# sqrt(n) eps relative (1.6e-5, 1.2e-4 of a loss near 8), and a step's loss, the mean over its 512
# tokens, by about 5e-6; later steps add the weights' differences, each update's rounding times the
# learning rate. 1e-4 is 20x that (measured: at most 1.9e-6 over the layout matrix's 68 trained
# points, docs/parity.md). The final gradient norm sums the squares of millions of elements, each
# already moved by the trajectory: 1e-3 relative against 3.2e-5 measured at most.
LOSS_TOLERANCE = 1e-4
GRAD_NORM_RTOL = 1e-3
# Float8 layouts: the baseline runs float8 too. Float8 scales each activation by its own maximum,
# which under data parallelism is taken over the rank's rows only, so the quantisation (and the
# loss) moves a little; float8 itself moves the loss by about 2.5e-3 against fp32 here.
FLOAT8 = "--float8.enable_float8_linear --float8.emulate"
FLOAT8_TOLERANCE = 1e-3
# Qwen3 runs its smallest flavors: what they prove (experts, q/k norms, the layouts) does not need more.
QWEN3_MOE = "--model.name qwen3 --model.flavor tiny_moe --moe.aux_loss_coef 0.001 --moe.bias_update_rate 0.001"
QWEN3_DENSE = "--model.name qwen3 --model.flavor tiny"
# The dropping mode at a factor that drops a few percent of tiny_moe's token choices per step.
QWEN3_MOE_CAPACITY = f"{QWEN3_MOE} --moe.capacity_factor 1.0"
# DeepSeek-V3's `tiny`: latent attention, a dense and an MoE block (shared experts, group-limited
# sigmoid routing), multi-token prediction (depth 1), auxiliary loss and bias both on.
DEEPSEEK_V3 = ("--model.name deepseek_v3 --model.flavor tiny --moe.aux_loss_coef 0.001 --moe.bias_update_rate 0.001")
DEEPSEEK_V3_NO_MTP = f"{DEEPSEEK_V3} --model.mtp_depth 0"
DEEPSEEK_V3_DEBUG = DEEPSEEK_V3.replace("tiny", "debugmodel")
POSITIVE = Check("a count above 0", lambda n: n > 0)
# bf16 compute (training.mixed_precision_param) on llama3's 2-block `tiny` model: the seed and
# the baseline (one process under autocast) too. bf16 rounds each matmul's output to 8 bits of
# mantissa, and layouts split those matmuls differently (rows over ranks, columns over TP ranks,
# FSDP casting the norm weights too), so their losses agree to bf16's precision, not fp32's.
BF16 = "--model.name llama3 --model.flavor tiny --training.mixed_precision_param bfloat16"
# Measured over 6 steps: DDP, TP and PP (autocast, as the baseline) within 1.1e-4 of the loss and
# 3.4e-5 of the grad norm; FSDP (whose policy casts every parameter, norms included) 1.8e-3 and 1.1e-3.
# Every CPU kernel accumulates a bf16 matmul in fp32 and rounds its output once, so these hold on
# any CPU: with PyTorch's own bf16 matmul, as without AVX-512 (ATEN_CPU_CAPABILITY=avx2, oneDNN off),
# the same within 1.1e-4 and 3.3e-5, FSDP 1.8e-3 and 1.1e-3.
BF16_TOLERANCES = {"loss_tolerance": 1e-3, "grad_norm_rtol": 1e-3}
BF16_FSDP_TOLERANCES = {"loss_tolerance": 1e-2, "grad_norm_rtol": 1e-2}
# Document masking (training.document_mask): the seed and the baseline mask documents too.
DOCUMENT_MASK = "--training.document_mask"
# An interleaved pipeline of 4 stages on 2 ranks needs at least 4 blocks: the debug model's 8.
DOCUMENT_MASK_8_BLOCKS = f"{DOCUMENT_MASK} --model.name llama3 --model.flavor debugmodel"


# Muon (optimizer.name): the seed and the baseline (one process) run Muon too. Each layout gathers
# the matrices' updates another way (FSDP shards rows, TP rows or columns, both, HSDP + ZeRO-1 owners
# over the replicas), or needs nothing gathered (PP; EP splits the experts, orthogonalised one by one).
MUON = "--optimizer.name Muon"
GATHERED = Check("some matrices gathered", lambda n: n > 0)


# No loss after each end-of-text token (training.mask_loss_after_eos): seed and baseline too.
MASK_AFTER_EOS = "--training.mask_loss_after_eos"
# Hand-picked layouts for what the layout matrix (tests/machinery/layout_matrix.py) does not vary:
# options of one parallelism (DDP buckets, FSDP resharding and offload, vocabulary padding, CSV schedules) and
# float8. The layouts themselves, every combination of degrees and the variants that interact
# with them, are the matrix's job. Each suite runs against a baseline of the debug model.
SUITES: dict[str, list[Layout]] = {
    "dp": [
        L("ddp2_bucket1mb_accum2", 2, "--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 1 "
          "--training.ddp_bucket_cap_mb 1 --training.gradient_accumulation_steps 2",
          {"ddp.kind": "ddp", "ddp.mesh": {"dp_replicate": 2}, "ddp.bucket_cap_mb": 1}),
        # Gradients kept unsharded across the micro-steps and reduce-scattered once (the default
        # reduce-scatters each micro-step; the matrix's accumulation points run that).
        L("fsdp2_defer_reduction_accum2", 2, "--training.data_parallel_shard_degree 2 "
          "--training.gradient_accumulation_steps 2 --training.defer_sharded_gradient_reduction",
          {"fsdp.mesh": {"dp_shard_cp": 2}}),
        L("fsdp2_reshard_never", 2, "--training.data_parallel_shard_degree 2 --training.fsdp_reshard_after_forward never",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "fsdp.reshard_after_forward": "never"}),
        L("fsdp2_cpu_offload", 2, "--training.data_parallel_shard_degree 2 --training.enable_cpu_offload",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "fsdp.cpu_offload": True}),
        # Activation offload (every block) beside selective AC: the checkpointed blocks offload their
        # input, the others everything they save; FSDP gathers and frees the parameters in between.
        L("fsdp2_activation_offload_ac", 2, "--training.data_parallel_shard_degree 2 --activation_checkpoint.mode "
          "selective --activation_checkpoint.offload all",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "activation_checkpoint.wrapped": ["layers.0"],
           "activation_checkpoint.offloaded": ["layers.0", "layers.1"]}),
    ],
    "tp": [
        L("tp2_padded_vocab", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "model.vocab_size": 2256, "model.vocab_padding": 48},
          shared="--model.vocab_size_divisible_by 64"),
    ],
    "pp": [
        L("pp2_csv_1f1b", 2, "--experimental.pipeline_parallel_degree 2 "
          "--experimental.pipeline_parallel_schedule_csv bundled:train_configs/pipeline_schedules/1f1b_pp2_2microbatches.csv",
          {"pipeline.schedule": "CSV", "pipeline.microbatches": 2, "pipeline.stages": 2}),
    ],
    # Qwen3 (the second family, registered like any user model): mixture of experts with expert
    # parallelism composed with every other dimension, against one process of the same MoE model
    # (auxiliary loss and auxiliary-loss-free bias both on), and the dense model under 2-D layouts.
    "moe": [
        L("moe_ep2", 2, "--training.expert_parallel_degree 2",
          {"mesh": {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 2}, "moe.ep_mesh": {"ep": 2}}, shared=QWEN3_MOE),
        L("moe_ep4", 4, "--training.expert_parallel_degree 4",
          {"moe.ep_mesh": {"ep": 4}}, shared=QWEN3_MOE),
        L("moe_ep2_fsdp4", 4, "--training.expert_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "moe.expert_fsdp_mesh": {"efsdp": 2}, "fsdp.mesh": {"dp_shard_cp": 4}},
          shared=QWEN3_MOE),
        L("moe_ep2_tp2", 4, "--training.expert_parallel_degree 2 --training.tensor_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "tp.mesh": {"tp": 2}}, shared=QWEN3_MOE),
        L("moe_ep2_pp2", 4, "--training.expert_parallel_degree 2 --experimental.pipeline_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "pipeline.stages": 2}, shared=QWEN3_MOE),
        L("moe_ep2_cp2", 4, "--training.expert_parallel_degree 2 --experimental.context_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "cp.mesh": {"cp": 2}}, shared=QWEN3_MOE),
        # The dropping mode: capacity per sequence, so 2 sequences per rank and micro-step (EP 2,
        # accumulation 2) drop what one process's 8 sequences at once drop.
        L("moe_capacity_ep2_accum2", 2, "--training.expert_parallel_degree 2 --training.gradient_accumulation_steps 2",
          {"moe.ep_mesh": {"ep": 2}, "moe.capacity_factor": 1.0}, shared=QWEN3_MOE_CAPACITY),
        L("qwen3_fsdp2_tp2", 4, "--training.tensor_parallel_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "tp.mesh": {"tp": 2}}, shared=QWEN3_DENSE),
        L("qwen3_pp2", 2, "--experimental.pipeline_parallel_degree 2", {"pipeline.stages": 2}, shared=QWEN3_DENSE),
    ],
    # DeepSeek-V3 (issue 39's rows): expert parallelism alone and with FSDP, TP and PP (MTP on the
    # last stage, its embedding copy tied to the first stage's), context parallelism (latent
    # attention in the ring; MTP off, which context parallelism refuses), and MTP off under FSDP.
    "deepseek_v3": [
        L("dsv3_ep2", 2, "--training.expert_parallel_degree 2", {"moe.ep_mesh": {"ep": 2}}, shared=DEEPSEEK_V3),
        L("dsv3_ep2_fsdp4", 4, "--training.expert_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "moe.expert_fsdp_mesh": {"efsdp": 2}, "fsdp.mesh": {"dp_shard_cp": 4}},
          shared=DEEPSEEK_V3),
        L("dsv3_ep2_tp2", 4, "--training.expert_parallel_degree 2 --training.tensor_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "tp.mesh": {"tp": 2}}, shared=DEEPSEEK_V3),
        # The debug model (2 dense + 2 MoE blocks) cut so that both stages hold an MoE block.
        L("dsv3_ep2_pp2", 4, "--training.expert_parallel_degree 2 --experimental.pipeline_parallel_degree 2 "
          "--experimental.pipeline_parallel_split_points layers.3",
          {"moe.ep_mesh": {"ep": 2}, "pipeline.stages": 2}, shared=DEEPSEEK_V3_DEBUG),
        # Tensor parallelism without sequence or loss parallelism: the replicated MLA compressions
        # and MTP's per-token parts see whole sequences, the MTP loss whole logits.
        L("dsv3_tp2_no_sp", 2, "--training.tensor_parallel_degree 2 --training.disable_sequence_parallel "
          "--training.disable_loss_parallel", {"tp.mesh": {"tp": 2}, "tp.sequence_parallel": False}, shared=DEEPSEEK_V3),
        L("dsv3_cp2", 2, "--experimental.context_parallel_degree 2", {"cp.mesh": {"cp": 2}}, shared=DEEPSEEK_V3_NO_MTP),
        # The dropping mode under a pipeline (MTP's MoE block on the last stage drops tokens too).
        L("dsv3_capacity_ep2_pp2", 4, "--training.expert_parallel_degree 2 --experimental.pipeline_parallel_degree 2 "
          "--experimental.pipeline_parallel_split_points layers.3",
          {"moe.ep_mesh": {"ep": 2}, "moe.capacity_factor": 1.0, "pipeline.stages": 2},
          shared=f"{DEEPSEEK_V3_DEBUG} --moe.capacity_factor 1.0"),
        L("dsv3_fsdp2_no_mtp", 2, "--training.data_parallel_shard_degree 2", {"fsdp.mesh": {"dp_shard_cp": 2}},
          shared=DEEPSEEK_V3_NO_MTP),
    ],
    # Document masking through each way the document ids travel: beside the tokens into an FSDP
    # model whose blocks are compiled (accumulating gradients), into TP ranks that gather the
    # sequence before attention (sequence parallel, op-level AC keeping the masked attention), and
    # as keyword inputs the schedule cuts into microbatches for every stage (4 stages on 2 ranks).
    "document_mask": [
        L("docmask_fsdp2_compile_accum2", 2, "--training.data_parallel_shard_degree 2 --training.compile "
          "--training.gradient_accumulation_steps 2", {"fsdp.mesh": {"dp_shard_cp": 2}, "compile.compiled_modules": POSITIVE},
          shared=DOCUMENT_MASK),
        L("docmask_tp2_sp_ac_op", 2, "--training.tensor_parallel_degree 2 --activation_checkpoint.mode selective "
          "--activation_checkpoint.selective_ac_option op",
          {"tp.mesh": {"tp": 2}, "tp.sequence_parallel": True, "activation_checkpoint.op_level": True},
          shared=DOCUMENT_MASK),
        L("docmask_pp2_interleaved", 2, "--experimental.pipeline_parallel_degree 2 "
          "--experimental.pipeline_parallel_schedule Interleaved1F1B",
          {"pipeline.schedule": "Interleaved1F1B", "pipeline.stages": 4}, shared=DOCUMENT_MASK_8_BLOCKS),
        # Context parallelism plans its attention blocks from the documents (skipping what they
        # mask), with either method, compiled or not, beside FSDP, TP and PP.
        L("docmask_cp2_compile", 2, "--experimental.context_parallel_degree 2 --training.compile",
          {"cp.mesh": {"cp": 2}, "cp.methods": ["ring"], "compile.compiled_modules": POSITIVE}, shared=DOCUMENT_MASK),
        L("docmask_cp2_fsdp2_allgather", 4, "--experimental.context_parallel_degree 2 "
          "--training.data_parallel_shard_degree 2 --experimental.context_parallel_method allgather",
          {"cp.mesh": {"cp": 2}, "cp.methods": ["allgather"], "fsdp.mesh": {"dp_shard_cp": 4}}, shared=DOCUMENT_MASK),
        L("docmask_cp2_tp2", 4, "--experimental.context_parallel_degree 2 --training.tensor_parallel_degree 2",
          {"cp.mesh": {"cp": 2}, "tp.mesh": {"tp": 2}}, shared=DOCUMENT_MASK),
        L("docmask_cp2_pp2_allgather", 4, "--experimental.context_parallel_degree 2 "
          "--experimental.pipeline_parallel_degree 2 --experimental.context_parallel_method allgather",
          {"cp.mesh": {"cp": 2}, "cp.methods": ["allgather"], "pipeline.stages": 2}, shared=DOCUMENT_MASK),
    ],
    # bf16 compute: FSDP's mixed-precision policy, or autocast where FSDP does not shard (one
    # process, DDP, TP, PP), against one process under autocast. The 2-block `tiny` model keeps
    # emulated bf16 (CPUs without AVX512-BF16 or AMX) fast; see BF16_TOLERANCES.
    "bf16": [
        L("bf16_fsdp2", 2, "--training.data_parallel_shard_degree 2",
          {"fsdp.param_dtype": "bfloat16", "autocast": None}, shared=BF16, **BF16_FSDP_TOLERANCES),
        L("bf16_ddp2", 2, "--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 1",
          {"ddp.kind": "ddp", "autocast.dtype": "bfloat16"}, shared=BF16, **BF16_TOLERANCES),
        L("bf16_tp2", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "autocast.dtype": "bfloat16"}, shared=BF16, **BF16_TOLERANCES),
        L("bf16_pp2", 2, "--experimental.pipeline_parallel_degree 2",
          {"pipeline.stages": 2, "autocast": {"dtype": "bfloat16", "parts": 1}}, shared=BF16, **BF16_TOLERANCES),
    ],
    # Chunked cross-entropy (training.loss_chunk_size) against the plain baseline's whole logits:
    # the head computed inside FSDP's root unit, which reshards after forward and gathers again
    # for backward's recomputation; vocabulary-sharded chunks under loss parallelism with a padded
    # vocabulary (sequence parallel); on a pipeline's last stage, the labels cut into microbatches.
    # Every run validates too, so the validation loss goes through the head as well.
    "chunked_loss": [
        L("chunked_loss_fsdp2", 2, "--training.data_parallel_shard_degree 2 --training.loss_chunk_size 24 "
          "--training.fsdp_reshard_after_forward always",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "chunked_loss": {"chunk_size": 24, "ranks": [0, 1]}}),
        L("chunked_loss_tp2_padded_vocab", 2, "--training.tensor_parallel_degree 2 --training.loss_chunk_size 24",
          {"tp.mesh": {"tp": 2}, "tp.loss_parallel": True, "model.vocab_padding": 48,
           "chunked_loss": {"chunk_size": 24, "ranks": [0, 1]}}, shared="--model.vocab_size_divisible_by 64"),
        L("chunked_loss_pp2", 2, "--experimental.pipeline_parallel_degree 2 --training.loss_chunk_size 24",
          {"pipeline.stages": 2, "chunked_loss": {"chunk_size": 24, "ranks": [1]}}),
    ],
    "muon": [
        L("muon_fsdp2", 2, "--training.data_parallel_shard_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "muon.gathered_matrices": GATHERED}, shared=MUON),
        L("muon_tp2", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "muon.gathered_matrices": GATHERED}, shared=MUON),
        # FSDP over TP's row split of the same dim (a _StridedShard beside a Shard): both gathered.
        L("muon_fsdp2_tp2", 4, "--training.data_parallel_shard_degree 2 --training.tensor_parallel_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "tp.mesh": {"tp": 2}, "muon.gathered_matrices": GATHERED}, shared=MUON),
        L("muon_pp2", 2, "--experimental.pipeline_parallel_degree 2",
          {"pipeline.stages": 2, "muon.gathered_matrices": 0}, shared=MUON),
        L("muon_moe_ep2", 2, "--training.expert_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "muon.matrices": POSITIVE}, shared=f"{QWEN3_MOE} {MUON}"),
        L("muon_hsdp_zero1", 4, "--training.data_parallel_replicate_degree 2 --training.data_parallel_shard_degree 2 "
          "--optimizer.zero1", {"zero1.replicas": 2, "muon.gathered_matrices": GATHERED}, shared=MUON),
    ],
    # Labels that carry no loss (training.mask_loss_after_eos, the seed and baseline too): the
    # step's loss is the sum over valid tokens divided by their count over the whole step, so
    # micro-batches, data-parallel and context-parallel ranks holding different counts, and a
    # pipeline's microbatches, weigh each token as one process does; validation too.
    "loss_tokens": [
        L("masked_fsdp2_accum2_chunked", 2, "--training.data_parallel_shard_degree 2 "
          "--training.gradient_accumulation_steps 2 --training.loss_chunk_size 24",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "chunked_loss": {"chunk_size": 24, "ranks": [0, 1]}}, shared=MASK_AFTER_EOS),
        L("masked_cp2", 2, "--experimental.context_parallel_degree 2", {"cp.mesh": {"cp": 2}}, shared=MASK_AFTER_EOS),
        L("masked_pp2_accum2", 2, "--experimental.pipeline_parallel_degree 2 --training.gradient_accumulation_steps 2",
          {"pipeline.stages": 2}, shared=MASK_AFTER_EOS),
    ],
    # Float8 linear layers (torchao), emulated on CPU: compared with one process running float8 too.
    "float8": [
        L("float8_fsdp2", 2, "--training.data_parallel_shard_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "float8.linears": POSITIVE, "float8.fsdp_float8_all_gather": False},
          shared=FLOAT8, loss_tolerance=FLOAT8_TOLERANCE),
        L("float8_fsdp2_float8_gather", 2, "--training.data_parallel_shard_degree 2 "
          "--float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "float8.fsdp_float8_all_gather": True},
          shared=FLOAT8, loss_tolerance=FLOAT8_TOLERANCE),
        L("float8_tp2", 2, "--training.tensor_parallel_degree 2 --training.disable_sequence_parallel",
          {"tp.mesh": {"tp": 2}, "tp.sequence_parallel": False, "tp.float8_linears": POSITIVE},
          shared=FLOAT8, loss_tolerance=FLOAT8_TOLERANCE),
    ],
}


def all_layouts() -> dict[str, Layout]:
    return {layout.name: layout for suite in SUITES.values() for layout in suite}


@dataclass
class RunResult:
    name: str
    nproc: int
    records: list[dict]  # rank 0's metrics.jsonl rows, one per step
    stdout: str
    seconds: float
    setup: dict = field(default_factory=dict)  # the run's setup record: what it applied and loaded
    validations: list[dict] = field(default_factory=list)  # its validation rows

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


@dataclass
class Comparison:
    layout: Layout
    run: RunResult
    loss_diffs: list[float] = field(default_factory=list)
    grad_norm_rel_diff: float = 0.0
    validation_diffs: list[float] = field(default_factory=list)

    @property
    def max_loss_diff(self) -> float:
        """Over the training and the validation losses."""
        return max(self.loss_diffs + self.validation_diffs)


class ParityError(AssertionError):
    """A layout that trained but did not match the baseline, or was not applied as declared."""


def local_batch_size(global_batch: int, overrides: tuple[str, ...], nproc: int) -> int:
    """Rows per rank and micro-step that keep `global_batch` rows per optimizer step; ConfigError
    when the layout's data-parallel degree x accumulation does not divide them."""
    config = parse_args([*DEBUG_RUN, *overrides])
    dims = parallel_dims_from_config(config, nproc)
    per_step = dims.dp_degree * config.training.gradient_accumulation_steps
    if global_batch % per_step:
        raise ConfigError(f"global batch {global_batch} does not divide by data-parallel degree x accumulation {per_step}")
    return global_batch // per_step


class ParityHarness:
    """Runs the seed checkpoint, the baseline and any number of layouts under `workdir`.

    Each run is done once and cached, so tests of one session share the seed and the baseline.
    Every run goes through `runner`: by default real processes in the current directory (the
    runs' relative paths resolve there); loss_compare.py passes its repository root, the test
    suite its warm runner.
    """

    def __init__(self, workdir: Path, steps: int = 10, global_batch: int = 8, dataset_shards: int = 4,
                 loss_tolerance: float = LOSS_TOLERANCE, grad_norm_rtol: float = GRAD_NORM_RTOL, timeout: int = 400,
                 runner: Runner = run_trainer, base_args: Sequence[str] = DEBUG_RUN):
        self.workdir = Path(workdir)
        self.runner = runner
        self.base_args = tuple(base_args)  # the job every run starts from (DEBUG_RUN: the debug model)
        self.steps, self.global_batch, self.dataset_shards = steps, global_batch, dataset_shards
        self.loss_tolerance, self.grad_norm_rtol, self.timeout = loss_tolerance, grad_norm_rtol, timeout
        self._runs: dict[str, RunResult] = {}

    @staticmethod
    def _variant(shared: tuple[str, ...]) -> str:
        """Folder suffix of the seed and baseline made with `shared` overrides ('' for none)."""
        return "" if not shared else "-" + "_".join(a.lstrip("-").replace(".", "_") for a in shared)

    def common_args(self, shared: tuple[str, ...] = ()) -> list[str]:
        """The arguments every run of a comparison shares (the seed checkpoint included)."""
        return [*self.base_args, "--training.steps", str(self.steps), *COMPARISON_ARGS,
                "--training.dataset_shards", str(self.dataset_shards),
                "--checkpoint.initial_load_path", str(self.seed_checkpoint(shared)), *shared]

    def seed_checkpoint(self, shared: tuple[str, ...] = ()) -> Path:
        folder = self.workdir / f"seed{self._variant(shared)}"
        path = folder / "checkpoint" / "step-0"
        if not path.exists():
            self.runner([*self.base_args, *shared, "--job.dump_folder", str(folder), "--checkpoint.create_seed_checkpoint"],
                        timeout=self.timeout)
        return path

    def run(self, layout: Layout) -> RunResult:
        if layout.name not in self._runs:
            folder = self.workdir / layout.name
            batch = local_batch_size(self.global_batch, (*layout.shared, *layout.overrides), layout.nproc)
            args = [*self.common_args(layout.shared), "--job.dump_folder", str(folder), "--training.batch_size", str(batch),
                    *layout.overrides]
            start = time.perf_counter()
            result = self.runner(args, nproc=layout.nproc, timeout=self.timeout)
            seconds = time.perf_counter() - start
            setup = read_setup(folder) or {}
            seed = self.seed_checkpoint(layout.shared).resolve()
            from_seed = Check(f"weights loaded from {seed}", lambda load: load is not None and load["weights_only"]
                              and Path(load["path"]).resolve() == seed)
            if unmet(setup, (("initial_load", from_seed),)):
                raise ParityError(f"{layout.name}: the run did not start from the seed checkpoint "
                                  f"(initial_load: {setup.get('initial_load', 'no setup record')})")
            failures = unmet(setup, layout.expect)
            if failures:
                raise ParityError(f"{layout.name}: the layout was not applied: {'; '.join(failures)}")
            self._runs[layout.name] = RunResult(layout.name, layout.nproc, read_metrics(folder), result.stdout, seconds,
                                                setup, read_validations(folder))
        return self._runs[layout.name]

    def baseline(self, shared: tuple[str, ...] = ()) -> RunResult:
        return self.run(Layout(f"baseline{self._variant(shared)}", 1, (), shared=shared))

    def compare(self, layout: Layout) -> Comparison:
        base, run = self.baseline(layout.shared), self.run(layout)
        if [r["step"] for r in run.records] != [r["step"] for r in base.records]:
            raise ParityError(f"{layout.name}: logged steps {[r['step'] for r in run.records]} differ from the baseline's")
        if [r["step"] for r in run.validations] != [r["step"] for r in base.validations]:
            raise ParityError(f"{layout.name}: validated at steps {[r['step'] for r in run.validations]}, the baseline "
                              f"at {[r['step'] for r in base.validations]}")
        diffs = [abs(a - b) for a, b in zip(base.losses, run.losses)]
        validation_diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base.validations, run.validations)]
        g0, g1 = base.records[-1]["grad_norm"], run.records[-1]["grad_norm"]
        return Comparison(layout, run, diffs, abs(g1 - g0) / abs(g0), validation_diffs)

    def tolerance_for(self, layout: Layout) -> float:
        return self.loss_tolerance if layout.loss_tolerance is None else layout.loss_tolerance

    def check(self, layout: Layout) -> Comparison:
        """Compares and raises ParityError when the layout is outside the tolerances."""
        c = self.compare(layout)
        tolerance = self.tolerance_for(layout)
        if c.max_loss_diff > tolerance:
            base = self.baseline(layout.shared)
            pairs = [(round(a, 7), round(b, 7)) for a, b in zip(base.losses, c.run.losses)]
            validation = [(r["step"], round(a["loss"], 7), round(r["loss"], 7)) for a, r in zip(base.validations,
                                                                                              c.run.validations)]
            raise ParityError(f"{layout.name}: max |loss diff| {c.max_loss_diff:.3e} > {tolerance:g}; "
                              f"(baseline, layout) per step: {pairs}; validation (step, baseline, layout): {validation}")
        grad_norm_rtol = self.grad_norm_rtol if layout.grad_norm_rtol is None else layout.grad_norm_rtol
        if c.grad_norm_rel_diff > grad_norm_rtol:
            raise ParityError(f"{layout.name}: final grad norm differs by {c.grad_norm_rel_diff:.3e} (relative) "
                              f"> {grad_norm_rtol:g}")
        return c
