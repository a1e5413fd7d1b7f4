"""The device a rank computes on, the features that need a particular one, and seeding."""

from __future__ import annotations

import os

import torch

from torchtitan.errors import ConfigError


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device_features(job_config, dev_type: str) -> None:
    """Features that need a GPU, refused on other devices before any process group exists."""
    if job_config.experimental.enable_async_tensor_parallel and dev_type != "cuda":
        raise ConfigError("experimental.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
                          "this machine has none")


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seeds every generator identically on all ranks; optionally forces deterministic kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # cuBLAS needs a fixed workspace to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
