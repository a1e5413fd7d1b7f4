"""The layout matrix's model: Llama 3 at the smallest sizes that still exercise every layout.

Registered as model `llama3_matrix` when imported (`--experimental.custom_import
torchtitan.tools.matrix_model`), through the same public TrainSpec API as any user model. On a
small CPU a parity run is bound by per-block overheads (collectives, DTensor dispatch), not by
FLOPs, so the matrix uses as few blocks as each layout's pipeline needs: flavor `L<n>` has n
blocks (2, 4, 8 or 16; a pipeline of s stages needs s blocks), `L<n>_tied` ties the embedding to the
output. Width 128 with 16 query and 8 key/value heads keeps grouped-query attention and lets
tensor parallelism go to 8 (heads, KV heads, the 512-wide feed-forward and the 2,256-token
vocabulary all divide by 8).
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama import llama3_configs
from torchtitan.models.train_spec import get_train_spec, register_train_spec, registered_names

MODEL_NAME = "llama3_matrix"
DEPTHS = (2, 4, 8, 16)


def flavor_name(depth: int, tied: bool) -> str:
    return f"L{depth}{'_tied' if tied else ''}"


def _flavors() -> dict:
    base = llama3_configs["debugmodel"]
    tied = llama3_configs["debugmodel_tied"]
    return {flavor_name(depth, is_tied): dataclasses.replace(tied if is_tied else base, dim=128, n_layers=depth,
                                                              n_heads=16, n_kv_heads=8)
            for depth in DEPTHS for is_tied in (False, True)}


if MODEL_NAME not in registered_names():  # importing twice (a warm process) registers once
    register_train_spec(dataclasses.replace(get_train_spec("llama3"), name=MODEL_NAME, config=_flavors()))
