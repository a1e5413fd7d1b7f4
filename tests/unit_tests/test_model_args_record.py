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


# ---------------------------------------------------------------------------------------------
# Records that tell less than a registered flavor would


@dataclasses.dataclass
class _NoDefaults:
    dim: int
    n_layers: int


@dataclasses.dataclass
class _ForwardReference:
    dim: int = 8
    scaling: "NotImportedHere | None" = None  # noqa: F821 - a name only a type checker would import


def test_args_without_defaults_take_every_field_from_the_record():
    # A converted folder's record over a family whose args have no defaults: the record fills them all.
    assert checkpoint_args({"x": _NoDefaults(1, 2)}, "hf", {"dim": 3, "n_layers": 4}) == _NoDefaults(3, 4)


def test_an_annotation_that_cannot_be_resolved_still_reads_plain_fields():
    assert args_from_record(_ForwardReference(), {"dim": 16}) == _ForwardReference(dim=16)


def test_a_record_of_an_unbuildable_model_has_unknown_tied_weights():
    from torchtitan.checkpoint.fit import checkpoint_record
    from torchtitan.checkpoint.folders import Manifest

    def lookup(name, flavor):
        raise KeyError(name)  # not registered in this process

    record = checkpoint_record(Manifest(step=0, contents=["model"], model={"name": "gone", "flavor": "x"}), lookup)
    assert record.name == "gone" and record.tied is None


def test_converting_a_checkpoint_of_an_unregistered_model_asks_for_the_head_count():
    from scripts.convert_checkpoint import _registry_args
    from torchtitan.checkpoint.folders import Manifest
    from torchtitan.errors import CheckpointError

    manifest = Manifest(step=0, contents=["model"], model={"name": "gpt9", "flavor": "x"})
    with pytest.raises(CheckpointError, match="is not a registered flavor, so its head count is unknown; pass --n-heads"):
        _registry_args(manifest, None)
    assert _registry_args(manifest, 8) is None
