"""A model registered with a builder of the pre-DataShards form (dp_rank, dp_degree), as an old
extension would: registration must refuse it with one line (tests/integration/test_bad_inputs.py)."""

import dataclasses

from torchtitan.models import get_train_spec, register_train_spec


def old_dataloader(job_config, tokenizer, dp_rank, dp_degree):
    raise AssertionError("never called: registration refuses the spec")


register_train_spec(dataclasses.replace(get_train_spec("llama3"), name="drifted", build_dataloader_fn=old_dataloader))
