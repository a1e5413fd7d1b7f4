"""Model registry. Importing this package registers the built-in model families."""

from torchtitan.models import (
    deepseek_v3,  # noqa: F401  (registers deepseek_v3)
    gpt_oss,  # noqa: F401  (registers gpt_oss)
    llama,  # noqa: F401  (registers llama2 and llama3)
    qwen3,  # noqa: F401  (registers qwen3, dense and MoE)
)
from torchtitan.models.train_spec import TrainSpec, get_train_spec, register_train_spec, registered_names

__all__ = ["TrainSpec", "get_train_spec", "register_train_spec", "registered_names"]
