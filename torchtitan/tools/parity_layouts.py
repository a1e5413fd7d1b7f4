"""The parity harness's hand-picked layouts (torchtitan/tools/parity.py runs them): options of one
parallelism that the layout matrix does not vary, float8, bf16 and the features' own suites, each
compared with one process of the same model and numerics. `scripts/loss_compare.py --suite NAME`
runs a suite; the test suite runs those the layout matrix's CI points do not prove already
(tests/integration/test_parity.py)."""

from __future__ import annotations

from typing import Any

from torchtitan.tools.parity import POSITIVE, Check, Layout


def L(name: str, nproc: int, overrides: str, expect: dict[str, Any] | None = None, shared: str = "",  # noqa: N802 - a table row
      loss_tolerance: float | None = None, grad_norm_rtol: float | None = None, model: str | None = None) -> Layout:
    return Layout(name, nproc, tuple(overrides.split()), tuple((expect or {}).items()), tuple(shared.split()),
                  loss_tolerance, grad_norm_rtol, None if model is None else tuple(model.split()))


# Float8 layouts: the baseline runs float8 too. Float8 scales each activation by its own maximum,
# which under data parallelism is taken over the rank's rows only, so the quantisation (and the
# loss) moves a little; float8 itself moves the loss by about 2.5e-3 against fp32 here.
FLOAT8 = "--float8.enable_float8_linear --float8.emulate"
FLOAT8_TOLERANCE = 1e-3
# The same holds for the gradient norm once micro-batches differ too (gradient accumulation scales
# each micro-batch's activations by its own maximum): e4m3 keeps 3 mantissa bits, so one value's
# rounding moves by up to 2^-4 of it, and a norm over many of them by about 1e-3 to 1e-2.
FLOAT8_GRAD_NORM_RTOL = 1e-2
# A layout that also cuts each rank's rows into several forwards (pipeline microbatches, gradient
# accumulation) scales each forward's few rows on their own: 2.1e-3 measured for 4 pipeline stages
# (microbatches of 2 rows against the baseline's 16) beside bf16 optimizer state and document
# masks; the layout matrix allows 5e-3 (about 6e-4 of the loss), still far below the moves of a
# real fault (a wrong gradient reduction moves it by 1e-2 to 1e-1 within a few steps).
FLOAT8_SPLIT_TOLERANCE = 5e-3
# Qwen3 runs its smallest flavors: what they prove (experts, q/k norms, the layouts) does not need more.
QWEN3_MOE = "--model.name qwen3 --model.flavor tiny_moe --moe.aux_loss_coef 0.001 --moe.bias_update_rate 0.001"
QWEN3_DENSE = "--model.name qwen3 --model.flavor tiny"
# The dropping mode at a factor that drops a few percent of tiny_moe's token choices per step.
QWEN3_MOE_CAPACITY = f"{QWEN3_MOE} --moe.capacity_factor 1.0"
# DeepSeek-V3's `tiny`: latent attention, a dense and an MoE block (shared experts, group-limited
# sigmoid routing), multi-token prediction (depth 1), auxiliary loss and bias both on.
DEEPSEEK_V3 = ("--model.name deepseek_v3 --model.flavor tiny --moe.aux_loss_coef 0.001 --moe.bias_update_rate 0.001")
DEEPSEEK_V3_NO_MTP = f"{DEEPSEEK_V3} --model.mtp_depth 0"
DEEPSEEK_V3_MTP2 = f"{DEEPSEEK_V3} --model.mtp_depth 2"
DEEPSEEK_V3_DEBUG = DEEPSEEK_V3.replace("tiny", "debugmodel")
# gpt-oss's `tiny`: a banded block (window 8, shorter than any rank's share of the 64-token
# sequences, so context parallelism's ring skips and masks key blocks) and a full one, sinks,
# biased attention, router and experts, the clamped SwiGLU; auxiliary loss and bias both on.
GPT_OSS = "--model.name gpt_oss --model.flavor tiny --moe.aux_loss_coef 0.001 --moe.bias_update_rate 0.001"
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


# LoRA (lora.rank): the baseline (one process) trains adapters of the same rank too, beside the base
# the seed checkpoint holds; the seed itself is made without LoRA (`model`), as a base is. Every
# adapted layer follows its base's TP split (parallelisms/lora.py), so the adapters' initial values
# and the losses must match one process's under every layout. A learning rate and scale at which
# the adapters move the losses within 6 steps: adapters drawn from another seed then end 6.9e-3 away
# in training and 2.2e-2 in validation (llama3 tiny), so equal losses show equal initial values.
LORA = "--lora.rank 8 --lora.alpha 32 --optimizer.lr 1e-2"
# llama3 tiny's adapters: 2 blocks x 8 x (q 128+128, k 128+64, v 128+64, o 128+128, w1/w3 128+512, w2 512+128).
LORA_TINY_TRAINABLE = 2 * 8 * (256 + 192 + 192 + 256 + 3 * 640)
QWEN3_MOE_BASE = "--model.name qwen3 --model.flavor tiny_moe --moe.aux_loss_coef 0.001"
# DeepSeek-V3 under LoRA: the routing bias is part of the frozen base (moe.bias_update_rate refused).
DEEPSEEK_V3_BASE = "--model.name deepseek_v3 --model.flavor tiny --moe.aux_loss_coef 0.001"
# all-linear on DeepSeek-V3 tiny (the MTP block's layers too): latent attention, dense and shared-expert MLPs.
DEEPSEEK_V3_TARGETS = sorted(["attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo",
                              *(f"{ffn}.{w}" for ffn in ("feed_forward", "shared_experts") for w in ("w1", "w2", "w3"))])


# No loss after each end-of-text token (training.mask_loss_after_eos): seed and baseline too.
MASK_AFTER_EOS = "--training.mask_loss_after_eos"
# Supervised fine-tuning (sft.format chat, seed and baseline too): the bundled reverse_words
# conversations rendered by the bundled chat tokenizer's template, whole conversations packed per row
# with document masks (each conversation, and the padding, a document of its own), loss only on the
# assistant turns: rows whose valid-label counts differ per rank, micro-batch and CP chunk.
SFT = ("--model.tokenizer_path bundled:chat_tokenizer --training.dataset reverse_words --sft.format chat "
       "--training.document_mask --training.seq_len 128")
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
        # The dropping mode compiled under EP: router, placement, experts (static all-to-alls) and
        # read-back each in one graph around the eager MoE layer (expert_parallel.compile_moe_parts).
        L("moe_capacity_ep2_compile", 2, "--training.expert_parallel_degree 2 --training.compile",
          {"moe.ep_mesh": {"ep": 2}, "moe.capacity_factor": 1.0, "compile.compiled_modules": POSITIVE},
          shared=QWEN3_MOE_CAPACITY),
        L("qwen3_fsdp2_tp2", 4, "--training.tensor_parallel_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "tp.mesh": {"tp": 2}}, shared=QWEN3_DENSE),
        L("qwen3_pp2", 2, "--experimental.pipeline_parallel_degree 2", {"pipeline.stages": 2}, shared=QWEN3_DENSE),
    ],
    # DeepSeek-V3 (issue 39's rows): expert parallelism alone and with FSDP, TP and PP (MTP on the
    # last stage, its embedding copy tied to the first stage's), context parallelism (latent
    # attention in the ring, the MTP block's too; MTP's labels ahead from the next chunk's rank), and
    # MTP off under FSDP.
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
        # MTP under CP 2 (FSDP over the cp ranks), full AC: the MTP module is an FSDP unit of its own
        # (blocks, MTP module, root; the MoE layers' units are not counted there), its block
        # checkpointed like the main blocks, its attention in the ring.
        L("dsv3_cp2", 2, "--experimental.context_parallel_degree 2 --activation_checkpoint.mode full",
          {"cp.mesh": {"cp": 2}, "cp.ring_attention_modules": 3, "mtp.depth": 1, "fsdp.modules": 4,
           "activation_checkpoint.wrapped": ["layers.0", "layers.1", "mtp.0.block"]}, shared=DEEPSEEK_V3),
        # MTP depth 2 under CP 2 with document masks and labels masked after each end of text:
        # the cp ranks hold their own numbers of valid targets (the masks, and the sequence's last two
        # positions on cp rank 0), which the loss mesh's count turns into one process's mean (a mean
        # over each rank's own targets misses by 1.7e-4); op-level AC keeps the MTP blocks' matmuls
        # and ring attention.
        L("dsv3_mtp2_cp2_masked", 2, "--experimental.context_parallel_degree 2 --activation_checkpoint.mode selective "
          "--activation_checkpoint.selective_ac_option op",
          {"cp.mesh": {"cp": 2}, "fsdp.mesh": {"dp_shard_cp": 2}, "mtp.depth": 2, "activation_checkpoint.op_level": True,
           "activation_checkpoint.wrapped": ["layers.0", "layers.1", "mtp.0.block", "mtp.1.block"]},
          shared=f"{DEEPSEEK_V3_MTP2} {DOCUMENT_MASK} {MASK_AFTER_EOS}"),
        # The dropping mode under a pipeline (MTP's MoE block on the last stage drops tokens too).
        L("dsv3_capacity_ep2_pp2", 4, "--training.expert_parallel_degree 2 --experimental.pipeline_parallel_degree 2 "
          "--experimental.pipeline_parallel_split_points layers.3",
          {"moe.ep_mesh": {"ep": 2}, "moe.capacity_factor": 1.0, "pipeline.stages": 2},
          shared=f"{DEEPSEEK_V3_DEBUG} --moe.capacity_factor 1.0"),
        L("dsv3_fsdp2_no_mtp", 2, "--training.data_parallel_shard_degree 2", {"fsdp.mesh": {"dp_shard_cp": 2}},
          shared=DEEPSEEK_V3_NO_MTP),
    ],
    # gpt-oss (issue 56): its attention (sinks, banded blocks, biases) and experts (biases, clamped
    # SwiGLU) under each parallelism alone, and experts over tensor-parallel ranks.
    "gpt_oss": [
        L("gptoss_fsdp2", 2, "--training.data_parallel_shard_degree 2", {"fsdp.mesh": {"dp_shard_cp": 2}}, shared=GPT_OSS),
        L("gptoss_tp2", 2, "--training.tensor_parallel_degree 2", {"tp.mesh": {"tp": 2}}, shared=GPT_OSS),
        L("gptoss_ep2", 2, "--training.expert_parallel_degree 2", {"moe.ep_mesh": {"ep": 2}}, shared=GPT_OSS),
        L("gptoss_pp2", 2, "--experimental.pipeline_parallel_degree 2", {"pipeline.stages": 2}, shared=GPT_OSS),
        L("gptoss_cp2", 2, "--experimental.context_parallel_degree 2", {"cp.mesh": {"cp": 2}}, shared=GPT_OSS),
        L("gptoss_ep2_tp2", 4, "--training.expert_parallel_degree 2 --training.tensor_parallel_degree 2",
          {"moe.ep_mesh": {"ep": 2}, "tp.mesh": {"tp": 2}}, shared=GPT_OSS),
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
    # LoRA: adapters laid out like their base under FSDP (sharded with their block), TP (column-wise
    # bases: lora_b split; row-wise: lora_a split, the adapter's partial sum reduced with the base's),
    # both, and PP (each stage adapted by the same parallelize function); Qwen3-MoE's attention beside
    # experts over TP; DeepSeek-V3's latent attention, whose compressions are whole on every tp rank.
    # The FSDP run saves adapters-only checkpoints (a resumed run must repeat it bitwise), the TP run
    # whole ones (its frozen base must come out bitwise the seed's).
    "lora": [
        L("lora_fsdp2", 2, "--training.data_parallel_shard_degree 2 --checkpoint.enable_checkpoint --checkpoint.interval 3",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "lora.rank": 8, "lora.trainable_parameters": LORA_TINY_TRAINABLE},
          shared=LORA, model=""),
        L("lora_tp2", 2, "--training.tensor_parallel_degree 2 --checkpoint.enable_checkpoint --lora.save_adapters_only false",
          {"tp.mesh": {"tp": 2}, "lora.layers": 14, "lora.trainable_parameters": LORA_TINY_TRAINABLE},
          shared=LORA, model=""),
        L("lora_fsdp2_tp2", 4, "--training.data_parallel_shard_degree 2 --training.tensor_parallel_degree 2",
          {"fsdp.mesh": {"dp_shard_cp": 2}, "tp.mesh": {"tp": 2}, "lora.trainable_parameters": LORA_TINY_TRAINABLE},
          shared=LORA, model=""),
        L("lora_pp2", 2, "--experimental.pipeline_parallel_degree 2",
          {"pipeline.stages": 2, "lora.layers": 7, "lora.trainable_parameters": LORA_TINY_TRAINABLE},
          shared=LORA, model=""),
        L("lora_qwen3_moe_tp2", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "lora.targets": ["attention.wk", "attention.wo", "attention.wq", "attention.wv"]},
          shared=f"{QWEN3_MOE_BASE} {LORA}", model=QWEN3_MOE_BASE),
        L("lora_dsv3_tp2", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "lora.targets": DEEPSEEK_V3_TARGETS}, shared=f"{DEEPSEEK_V3_BASE} {LORA}",
          model=DEEPSEEK_V3_BASE),
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
    "sft": [
        L("sft_fsdp2", 2, "--training.data_parallel_shard_degree 2", {"fsdp.mesh": {"dp_shard_cp": 2}}, shared=SFT),
        L("sft_tp2", 2, "--training.tensor_parallel_degree 2", {"tp.mesh": {"tp": 2}}, shared=SFT),
        L("sft_pp2", 2, "--experimental.pipeline_parallel_degree 2", {"pipeline.stages": 2}, shared=SFT),
        L("sft_cp2", 2, "--experimental.context_parallel_degree 2", {"cp.mesh": {"cp": 2}}, shared=SFT),
        L("sft_moe_ep2", 2, "--training.expert_parallel_degree 2", {"moe.ep_mesh": {"ep": 2}},
          shared=f"{QWEN3_MOE} {SFT}"),
        # DeepSeek-V3 (latent attention, multi-token prediction on the masked labels) split by heads.
        L("sft_dsv3_tp2", 2, "--training.tensor_parallel_degree 2", {"tp.mesh": {"tp": 2}},
          shared=f"{DEEPSEEK_V3} {SFT}"),
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
        # torchao's rowwise recipe: TP keeps the plain styles, so sequence parallelism runs on gloo
        # (float8 styles would send float8 tensors); the baseline runs rowwise too.
        L("float8_rowwise_tp2_sp", 2, "--training.tensor_parallel_degree 2",
          {"tp.mesh": {"tp": 2}, "tp.sequence_parallel": True, "tp.float8_linears": POSITIVE, "float8.scaling": "rowwise"},
          shared=FLOAT8 + " --float8.recipe rowwise", loss_tolerance=FLOAT8_TOLERANCE),
    ],
}


def all_layouts() -> dict[str, Layout]:
    return {layout.name: layout for suite in SUITES.values() for layout in suite}
