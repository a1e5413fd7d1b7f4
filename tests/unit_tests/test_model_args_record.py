"""Model args as checkpoints record them (torchtitan/checkpoint/model_args.py): every registered flavor of
every family comes back equal from its record, so a tool reading a checkpoint rebuilds the model that
wrote it without a registered flavor, for any family registered now or later."""

import dataclasses

import pytest

from torchtitan.checkpoint.model_args import args_from_record, args_record, checkpoint_args, differences
from torchtitan.models import get_train_spec, registered_names

FLAVORS = [(name, flavor) for name in registered_names() for flavor in get_train_spec(name).config]


@pytest.mark.parametrize("name,flavor", FLAVORS, ids=[f"{n}-{f}" for n, f in FLAVORS])
def test_every_flavor_comes_back_from_its_record(name, flavor):
    flavors = get_train_spec(name).config
    args = flavors[flavor]
    # As a converted checkpoint: no registered flavor, the family's defaults under the record.
    assert checkpoint_args(flavors, "hf", args_record(args)) == args
    assert checkpoint_args(flavors, flavor, {}) == args  # an older manifest: its flavor's alone
    assert checkpoint_args(flavors, "hf", {}) is None  # nothing tells


def test_a_record_overrides_its_flavor_and_unknown_fields_are_ignored():
    flavors = get_train_spec("llama3").config
    record = {**args_record(flavors["tiny"]), "dim": 64, "from_a_later_version": 1}
    assert checkpoint_args(flavors, "tiny", record) == dataclasses.replace(flavors["tiny"], dim=64)
    scaled = flavors["1B"]  # a nested dataclass (RoPE scaling) where the base has none
    assert args_from_record(dataclasses.replace(scaled, rope_scaling=None), args_record(scaled)) == scaled


def test_differences_name_both_sides_and_leave_out_run_settings():
    tiny = args_record(get_train_spec("llama3").config["tiny"])
    other = {**tiny, "n_kv_heads": None, "max_seq_len": 1, "rope_theta": 1.0}
    assert differences(other, tiny, "checkpoint", "this run") == {
        "n_kv_heads": "n_kv_heads 16 (checkpoint) vs 8 (this run)",
        "rope_theta": "rope_theta 1.0 (checkpoint) vs 500000.0 (this run)"}


CONVERTIBLE = [(name, flavor) for name, flavor in FLAVORS if get_train_spec(name).hf_adapter is not None]


@pytest.mark.parametrize("name,flavor", CONVERTIBLE, ids=[f"{n}-{f}" for n, f in CONVERTIBLE])
def test_a_conversion_of_a_flavors_config_json_is_recorded_as_that_flavor(name, flavor):
    """What hf-to-dcp records for a published model's folder: the flavor of its shapes and computation,
    whatever its vocabulary (so a run of that flavor loads it without a warning, another is refused
    naming both)."""
    from scripts.convert_checkpoint import _converted_manifest

    spec = get_train_spec(name)
    adapter = spec.hf_adapter
    args = adapter.model_args_from_hf_config(adapter.hf_config(dataclasses.replace(spec.config[flavor], vocab_size=1000)))
    manifest = _converted_manifest({}, name, args, "/models/x")
    assert manifest.model == {"name": name, "flavor": flavor} and manifest.converted_from == "/models/x"
    assert checkpoint_args(spec.config, "hf", manifest.model_args) == args
