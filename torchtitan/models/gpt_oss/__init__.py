"""gpt-oss (20B and 120B): flavors and their TrainSpec registration.

Everything the trainer needs from this family reaches it through the one TrainSpec below; shared
blocks come from torchtitan/models/common.py and torchtitan/models/moe.py, shared parallelisms from
torchtitan/parallelisms/.
"""

from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.models.gpt_oss.flavors import gpt_oss_configs
from torchtitan.models.gpt_oss.hf_adapter import GptOssHFAdapter
from torchtitan.models.gpt_oss.model import GptOss, GptOssModelArgs
from torchtitan.models.gpt_oss.parallelize_gpt_oss import parallelize_gpt_oss, validate_gpt_oss
from torchtitan.models.gpt_oss.pipeline_gpt_oss import pipeline_gpt_oss
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.train_spec import TrainSpec, register_train_spec
from torchtitan.parallelisms.expert_parallel import moe_after_step
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers

__all__ = ["GptOss", "GptOssModelArgs", "gpt_oss_configs", "parallelize_gpt_oss", "pipeline_gpt_oss"]

register_train_spec(
    TrainSpec(
        name="gpt_oss",
        model_cls=GptOss,
        config=gpt_oss_configs,
        parallelize_fn=parallelize_gpt_oss,
        pipelining_fn=pipeline_gpt_oss,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_text_dataloader,
        build_validation_dataloader_fn=build_validation_dataloader,
        loss_fn=cross_entropy_loss,
        validate_fn=validate_gpt_oss,
        after_step_fn=moe_after_step,
        hf_adapter=GptOssHFAdapter(),
    )
)
