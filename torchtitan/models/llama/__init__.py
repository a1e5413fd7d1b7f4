"""Llama 2 and Llama 3: flavors (published shapes) and their TrainSpec registrations."""

from torchtitan.datasets.text_dataset import build_text_dataloader, build_validation_dataloader
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaHFAdapter
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.parallelize_llama import parallelize_llama, validate_llama
from torchtitan.models.llama.pipeline_llama import pipeline_llama
from torchtitan.models.loss import cross_entropy_loss
from torchtitan.models.train_spec import TrainSpec, register_train_spec
from torchtitan.trainer.optimizer import build_lr_schedulers, build_optimizers

__all__ = ["ModelArgs", "Transformer", "parallelize_llama", "pipeline_llama", "llama2_configs", "llama3_configs"]

for _name, _configs in (("llama2", llama2_configs), ("llama3", llama3_configs)):
    register_train_spec(
        TrainSpec(
            name=_name,
            model_cls=Transformer,
            config=_configs,
            parallelize_fn=parallelize_llama,
            pipelining_fn=pipeline_llama,
            build_optimizers_fn=build_optimizers,
            build_lr_schedulers_fn=build_lr_schedulers,
            build_tokenizer_fn=build_tokenizer,
            build_dataloader_fn=build_text_dataloader,
            build_validation_dataloader_fn=build_validation_dataloader,
            loss_fn=cross_entropy_loss,
            validate_fn=validate_llama,
            hf_adapter=LlamaHFAdapter(),
        )
    )
