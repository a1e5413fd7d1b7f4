"""Qwen3, dense and mixture-of-experts: flavors and their TrainSpec registration.

Everything the trainer needs from this family reaches it through the one TrainSpec below; the
folder imports nothing from the Llama family (shared blocks come from torchtitan/models/common.py
and torchtitan/models/moe.py, shared parallelisms from torchtitan/parallelisms/).
"""

from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3HFAdapter
from torchtitan.models.qwen3.model import Qwen3, Qwen3ModelArgs
from torchtitan.models.qwen3.parallelize_qwen3 import parallelize_qwen3, validate_qwen3
from torchtitan.models.qwen3.pipeline_qwen3 import pipeline_qwen3
from torchtitan.models.train_spec import TrainSpec, register_train_spec
from torchtitan.parallelisms.expert_parallel import moe_after_step
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers

__all__ = ["Qwen3", "Qwen3ModelArgs", "qwen3_configs", "parallelize_qwen3", "pipeline_qwen3"]

register_train_spec(
    TrainSpec(
        name="qwen3",
        model_cls=Qwen3,
        config=qwen3_configs,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_qwen3,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_text_dataloader,
        build_validation_dataloader_fn=build_validation_dataloader,
        loss_fn=cross_entropy_loss,
        validate_fn=validate_qwen3,
        hf_adapter=Qwen3HFAdapter(),
        after_step_fn=moe_after_step,
    )
)
