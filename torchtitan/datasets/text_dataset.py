"""The data loaders of training and validation: text (packing.py) or, with sft.format,
conversations (sft.py), from the job's sources, for this rank's data shards."""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.chunks import Split
from torchtitan.datasets.mixture import Mixture, build_mixture
from torchtitan.datasets.packing import IGNORE_INDEX, PackedTextDataset, own_generator
from torchtitan.datasets.sft import conversation_dataset
from torchtitan.datasets.shards import DataShards
from torchtitan.datasets.shuffle import Shuffle
from torchtitan.datasets.sources import resolve_source
from torchtitan.datasets.tokenized import TokenizedSource
from torchtitan.datasets.tokenizer import Tokenizer

# Re-exported: where the rest of the package has always found them.
__all__ = ["IGNORE_INDEX", "PackedTextDataset", "Split", "build_text_dataloader", "build_validation_dataloader",
           "own_generator"]


def held_out_split(job_config: JobConfig, validation: bool) -> Split | None:
    """The split of the training source between training and validation: None (training reads
    everything) unless validation is on and has no dataset of its own."""
    options = job_config.validation
    if not options.enabled or options.dataset or options.dataset_path:
        return None
    return Split(options.held_out_fraction, validation)


def training_source(job_config: JobConfig) -> Any:
    """training.dataset_mix's Mixture, else the one source training.dataset / dataset_path name."""
    training = job_config.training
    if training.dataset_mix:
        return build_mixture(training.dataset_mix, training.seed if training.seed >= 0 else 0)
    return resolve_source(training.dataset, training.dataset_path)


def training_shuffle(job_config: JobConfig) -> Shuffle | None:
    """training.dataset_shuffle's order, seeded by training.seed (0 when unset), as the mixture is."""
    training = job_config.training
    return Shuffle(training.seed if training.seed >= 0 else 0) if training.dataset_shuffle else None


def _check_tokenized(source: Any, tokenizer: Tokenizer) -> None:
    for s in source.sources if isinstance(source, Mixture) else [source]:
        if isinstance(s, TokenizedSource):
            s.check_tokenizer(tokenizer)


def loss_mask_token(job_config: JobConfig, tokenizer: Tokenizer) -> int | None:
    """The end-of-text id under training.mask_loss_after_eos (the preflight refused a tokenizer
    without one), else None: no label is ignored."""
    return tokenizer.eos_id if job_config.training.mask_loss_after_eos else None


def build_text_dataloader(job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> StatefulDataLoader:
    training = job_config.training
    source = training_source(job_config)
    _check_tokenized(source, tokenizer)
    common = dict(infinite=training.dataset_infinite, skip_bad_lines=training.dataset_skip_bad_lines,
                  split=held_out_split(job_config, validation=False), num_workers=training.dataset_num_workers,
                  shuffle=training_shuffle(job_config))
    if job_config.sft.format:
        dataset = conversation_dataset(job_config, tokenizer, source, _source_option(job_config), training.batch_size,
                                       shards.owned, shards.count, **common)
    else:
        dataset = PackedTextDataset(source, tokenizer, training.seq_len, training.batch_size, shards.owned, shards.count,
                                    ignore_after=loss_mask_token(job_config, tokenizer), **common)
    # batch_size=None: the dataset yields whole batches (each assembled from its shards). Any worker
    # processes belong to the dataset's shard readers; packing runs here.
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0, generator=own_generator())


def _source_option(job_config: JobConfig) -> str:
    training = job_config.training
    return ("training.dataset_mix" if training.dataset_mix else "training.dataset_path" if training.dataset_path
            else "training.dataset")

def validation_batch_size(job_config: JobConfig) -> int:
    """Rows per data-parallel rank of a validation batch: validation.batch_size, by default the rows
    of one optimizer step (all its micro-batches), so a layout's validation batch, like its training
    step, depends only on the global batch."""
    training, validation = job_config.training, job_config.validation
    return validation.batch_size if validation.batch_size > 0 else training.batch_size * training.gradient_accumulation_steps


def build_validation_dataloader(job_config: JobConfig, tokenizer: Tokenizer, shards: DataShards) -> StatefulDataLoader:
    """Batches of the validation data (validation.dataset or dataset_path, else the training
    source's held-out split), read once from its start: finite, in the training process."""
    training, validation = job_config.training, job_config.validation
    if validation.dataset or validation.dataset_path:
        source = resolve_source(validation.dataset, validation.dataset_path, option="validation")
        split = Split(1.0, validation=True)  # all of it
    else:
        source = training_source(job_config)
        split = held_out_split(job_config, validation=True)
    _check_tokenized(source, tokenizer)
    common = dict(infinite=False, skip_bad_lines=training.dataset_skip_bad_lines, split=split)
    if job_config.sft.format:
        option = "validation.dataset_path" if validation.dataset or validation.dataset_path else _source_option(job_config)
        dataset = conversation_dataset(job_config, tokenizer, source, option, validation_batch_size(job_config),
                                       shards.owned, shards.count, **common)
    else:
        dataset = PackedTextDataset(source, tokenizer, training.seq_len, validation_batch_size(job_config), shards.owned,
                                    shards.count, ignore_after=loss_mask_token(job_config, tokenizer), **common)
    return StatefulDataLoader(dataset, batch_size=None, num_workers=0, generator=own_generator())
