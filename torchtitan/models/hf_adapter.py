"""HFAdapter: what a model family tells the checkpoint converter about its Hugging Face format.

torchtitan/checkpoint/hf_folder.py (safetensors folders, for any family) and
scripts/convert_checkpoint.py learn a family's parameter names, tensor layouts and config.json
only through the adapter its TrainSpec registers (`TrainSpec.hf_adapter`), so neither imports a
model family. Below, `args` is the family's model args (a dataclass, like a TrainSpec flavor).
Refusals of what the family cannot represent raise CheckpointError (torchtitan.errors) with one
line naming the field or tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol

if TYPE_CHECKING:
    import torch


class HFAdapter(Protocol):
    family: str  # the family in refusals: "... are not Llama parameters"
    hf_architecture: str  # HF's model class, as config.json's `architectures` names it: "LlamaForCausalLM"

    def to_hf_name(self, fqn: str) -> str:
        """HF's name for one of our parameter FQNs; KeyError for a name that is no parameter of the family."""
        ...

    def from_hf_name(self, name: str) -> str:
        """Our FQN for one of HF's parameter names; KeyError for any other name."""
        ...

    def whole_model_names(self, fqns: Iterable[str]) -> list[str]:
        """Every parameter FQN of a whole model with as many blocks as `fqns` reach (a tied output
        projection included): what a checkpoint holding `fqns` must hold. `fqns` are parameters."""
        ...

    def to_hf_tensor(self, fqn: str, w: torch.Tensor, args: Any) -> torch.Tensor:
        """Our tensor `fqn` in HF's layout (e.g. RoPE rows reordered); may be `w` itself."""
        ...

    def from_hf_tensor(self, fqn: str, w: torch.Tensor, args: Any) -> torch.Tensor:
        """HF's tensor for our `fqn` in our layout: the inverse of `to_hf_tensor`."""
        ...

    def ties_embeddings(self, args: Any) -> bool:
        """Whether the output projection is the embedding. HF then stores it once, as the embedding;
        our model keeps it under both names."""
        ...

    def hf_config(self, args: Any, torch_dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
        """The config.json of HF's model with the shapes and numerics of `args`; `extra` adds or
        overrides fields (bos_token_id / eos_token_id, which depend on the tokenizer)."""
        ...

    def model_args_from_hf_config(self, cfg: dict[str, Any]) -> Any:
        """The model args that a parsed config.json describes; CheckpointError for a field that
        changes the computation in a way this family cannot reproduce."""
        ...

    def args_with_shapes(self, base: Any | None, shapes: dict[str, tuple[int, ...]], n_heads: int | None,
                         n_kv_heads: int | None) -> Any:
        """`base` (the args of the checkpoint's flavor; None when it has none, the family's
        defaults) with every size the tensor `shapes` (our FQN -> shape) tell. Head counts do not
        show in shapes: `n_heads` and `n_kv_heads` are the user's, None where not given (the
        converter's --n-heads and --n-kv-heads, which the refusals name)."""
        ...
