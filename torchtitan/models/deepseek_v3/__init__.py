"""DeepSeek-V3: multi-head latent attention, MoE with shared experts and group-limited sigmoid
routing, multi-token prediction; flavors and the TrainSpec registration.

Everything the trainer needs from this family reaches it through the one TrainSpec below; the
folder imports nothing from the other families (shared blocks come from torchtitan/models/common.py
and torchtitan/models/moe.py, shared parallelisms from torchtitan/parallelisms/).
"""

from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.models.deepseek_v3.after_step import deepseek_v3_after_step
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_configs
from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from torchtitan.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.parallelize_deepseek_v3 import parallelize_deepseek_v3, validate_deepseek_v3
from torchtitan.models.deepseek_v3.pipeline_deepseek_v3 import pipeline_deepseek_v3
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.train_spec import TrainSpec, register_train_spec
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers

__all__ = ["DeepSeekV3", "DeepSeekV3ModelArgs", "deepseek_v3_configs", "parallelize_deepseek_v3",
           "pipeline_deepseek_v3"]

register_train_spec(
    TrainSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3,
        config=deepseek_v3_configs,
        parallelize_fn=parallelize_deepseek_v3,
        pipelining_fn=pipeline_deepseek_v3,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_text_dataloader,
        build_validation_dataloader_fn=build_validation_dataloader,
        loss_fn=cross_entropy_loss,
        validate_fn=validate_deepseek_v3,
        hf_adapter=DeepSeekV3HFAdapter(),
        after_step_fn=deepseek_v3_after_step,
    )
)
