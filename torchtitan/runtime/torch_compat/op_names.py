"""Names of private torch ops as profiles and pickles show them; importing this needs no torch."""

from __future__ import annotations

from torchtitan.runtime.torch_compat import PrivateName

# The fused attention kernels sdpa dispatches to (aten::<name> in a profile), by backend.
ATTENTION_KERNEL_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
GROUPED_MM_NAME = "_grouped_mm"
# Matmuls torch offers only as private ops (integer, float8-scaled, grouped).
PRIVATE_MATMUL_NAMES = ("_int_mm", "_scaled_mm", GROUPED_MM_NAME)
# What DCP's `.metadata` pickle names to rebuild a tensor layout (module, name): private to
# torch.serialization, but the pickles name it, so a restricted unpickler must allow it.
PICKLED_LAYOUT = ("torch.serialization", "_get_layout")

PRIVATE_NAMES = (
    # cuDNN attention exists in CUDA builds with cuDNN only.
    *(PrivateName(f"torch.ops.aten.{name}", optional="cudnn" in name) for name in ATTENTION_KERNEL_NAMES),
    *(PrivateName(f"torch.ops.aten.{name}") for name in PRIVATE_MATMUL_NAMES),
    PrivateName(".".join(PICKLED_LAYOUT), ("name",)),
)
