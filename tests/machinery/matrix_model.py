"""The layout matrix's model: Llama 3 at the smallest sizes that still exercise every layout.

Test machinery. Registered as model `llama3_matrix` when imported (`--experimental.custom_import
tests.machinery.matrix_model`, from the repository root), through the same public TrainSpec API
as any user model. On a small CPU a parity run is bound by per-block overheads (collectives,
DTensor dispatch), not by FLOPs, so the matrix uses as few blocks as each layout's pipeline needs: flavor `L<n>` has n
blocks (2, 4, 8 or 16; a pipeline of s stages needs s blocks), `L<n>_tied` ties the embedding to the
output. Width 128 with 16 query and 8 key/value heads keeps grouped-query attention and lets
tensor parallelism go to 8 (heads, KV heads, the 512-wide feed-forward and the 2,256-token
vocabulary all divide by 8).

`qwen3_moe_matrix` is the mixture-of-experts twin for the matrix's expert-parallel variant: Qwen3
blocks of the same width whose feed-forwards are 8 experts (top-2, 128 wide each), so expert
parallelism can go to 8; flavors `M<n>` and `M<n>_tied`.

`deepseek_v3_matrix` is the DeepSeek-V3 variant: deepseek_v3's `tiny` (width 128, 16 latent-attention
heads, 8 routed experts top-2 in 4 groups plus a shared one, one MTP module) at each depth, its first
block dense and the rest MoE; flavors `D<n>` (the family has no tied embeddings).

`gpt_oss_matrix` is the gpt-oss variant: gpt_oss's `tiny` (width 128, 16 query and 8 key/value heads
with sinks, banded blocks of window 8 alternating with full ones, 8 biased experts top-2 with the
clamped SwiGLU) at each depth; flavors `G<n>`.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.gpt_oss import gpt_oss_configs
from torchtitan.models.llama import llama3_configs
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.models.train_spec import get_train_spec, register_train_spec, registered_names

MODEL_NAME = "llama3_matrix"
MOE_MODEL_NAME = "qwen3_moe_matrix"
DSV3_MODEL_NAME = "deepseek_v3_matrix"
GPT_OSS_MODEL_NAME = "gpt_oss_matrix"
DEPTHS = (2, 4, 8, 16)


def flavor_name(depth: int, tied: bool, moe: bool = False, dsv3: bool = False, gptoss: bool = False) -> str:
    if dsv3 or gptoss:
        return f"{'D' if dsv3 else 'G'}{depth}"
    return f"{'M' if moe else 'L'}{depth}{'_tied' if tied else ''}"


def _flavors() -> dict:
    # llama3's `tiny` flavors at each depth: L2 is `tiny` itself.
    return {flavor_name(depth, is_tied): dataclasses.replace(llama3_configs["tiny_tied" if is_tied else "tiny"],
                                                              n_layers=depth)
            for depth in DEPTHS for is_tied in (False, True)}


def _moe_flavors() -> dict:
    # qwen3's `tiny_moe` at each depth: M2 is `tiny_moe` itself.
    return {flavor_name(depth, is_tied, moe=True): dataclasses.replace(qwen3_configs["tiny_moe"], n_layers=depth,
                                                                        tie_word_embeddings=is_tied)
            for depth in DEPTHS for is_tied in (False, True)}


def _dsv3_flavors() -> dict:
    # deepseek_v3's `tiny` at each depth: D2 is `tiny` itself (one dense block, then MoE blocks).
    return {flavor_name(depth, False, dsv3=True): dataclasses.replace(deepseek_v3_configs["tiny"], n_layers=depth)
            for depth in DEPTHS}


def _gpt_oss_flavors() -> dict:
    # gpt_oss's `tiny` at each depth: G2 is `tiny` itself (a banded block, then a full one, alternating).
    return {flavor_name(depth, False, gptoss=True): dataclasses.replace(gpt_oss_configs["tiny"], n_layers=depth)
            for depth in DEPTHS}


if MODEL_NAME not in registered_names():  # importing twice (a warm process) registers once
    register_train_spec(dataclasses.replace(get_train_spec("llama3"), name=MODEL_NAME, config=_flavors()))
if MOE_MODEL_NAME not in registered_names():
    register_train_spec(dataclasses.replace(get_train_spec("qwen3"), name=MOE_MODEL_NAME, config=_moe_flavors()))
if DSV3_MODEL_NAME not in registered_names():
    register_train_spec(dataclasses.replace(get_train_spec("deepseek_v3"), name=DSV3_MODEL_NAME, config=_dsv3_flavors()))
if GPT_OSS_MODEL_NAME not in registered_names():
    register_train_spec(dataclasses.replace(get_train_spec("gpt_oss"), name=GPT_OSS_MODEL_NAME, config=_gpt_oss_flavors()))
