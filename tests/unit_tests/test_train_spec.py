"""The TrainSpec contract: registration refuses builders whose parameters drift from the
Protocols in torchtitan/models/train_spec.py, and the built-in families satisfy them."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.errors import ConfigError
from torchtitan.models import get_train_spec, registered_names
from torchtitan.models.train_spec import (
    _BUILDERS,
    PipeliningFn,
    TrainSpec,
    ValidateFn,
    register_train_spec,
    signature_mismatch,
)


def _spec(name: str, **changes) -> TrainSpec:
    return dataclasses.replace(get_train_spec("llama3"), name=name, **changes)


@pytest.mark.parametrize("model", ["llama2", "llama3", "qwen3"])
def test_built_in_families_match_every_builder_protocol(model):
    spec = get_train_spec(model)
    for field, protocol in _BUILDERS.items():
        fn = getattr(spec, field)
        assert fn is not None or field in ("pipelining_fn", "validate_fn", "after_step_fn")
        if fn is not None:
            assert signature_mismatch(fn, protocol) is None, field


def test_a_pipelining_fn_of_the_old_positional_form_is_refused():
    def old_pipelining(model, parallel_dims, job_config, device, model_args, loss_fn):
        return None

    with pytest.raises(TypeError, match=r"pipelining_fn .*old_pipelining has no parameter 'plan'"):
        register_train_spec(_spec("drifted_pp", pipelining_fn=old_pipelining))
    assert "drifted_pp" not in registered_names()


def test_a_validate_fn_that_misses_the_plan_is_refused():
    def validate(model_args, parallel_dims, job_config):
        pass

    with pytest.raises(TypeError, match="validate_fn .* takes 3 positional parameters, the trainer passes 4"):
        register_train_spec(_spec("drifted_validate", validate_fn=validate))


def test_extra_parameters_need_defaults():
    def parallelize(model, parallel_dims, job_config, compile_everything):
        return model

    with pytest.raises(TypeError, match="needs parameter 'compile_everything'"):
        register_train_spec(_spec("drifted_parallelize", parallelize_fn=parallelize))

    def parallelize_with_default(model, parallel_dims, job_config, compile_everything=False):
        return model

    assert signature_mismatch(parallelize_with_default, _BUILDERS["parallelize_fn"]) is None


def test_keyword_contract_accepts_any_order_and_kwargs():
    def pipelining(model, *, loss_fn, parallelize_fn, device, job_config, parallel_dims, plan, model_args):
        return None

    def pipelining_kwargs(model, **kwargs):
        return None

    assert signature_mismatch(pipelining, PipeliningFn) is None
    assert signature_mismatch(pipelining_kwargs, PipeliningFn) is None
    assert signature_mismatch(lambda args, dims, plan, config: None, ValidateFn) is None


def test_a_builtin_without_a_signature_is_trusted_and_a_non_callable_refused():
    assert signature_mismatch(max, _BUILDERS["loss_fn"]) is None  # inspect cannot read a signature of max
    with pytest.raises(TypeError, match=r"^TrainSpec 'not_callable': loss_fn 42 is not callable; see LossFn "):
        register_train_spec(_spec("not_callable", loss_fn=42))
    assert "not_callable" not in registered_names()


@pytest.mark.parametrize("missing,option,world,message", [
    ("pipelining_fn", ["--experimental.pipeline_parallel_degree", "2"], 2,
     "model 'no_pipelining_fn' has no pipelining_fn, so experimental.pipeline_parallel_degree must stay 1"),
    ("hf_adapter", ["--checkpoint.last_save_in_hf"], 1,
     "checkpoint.last_save_in_hf: model 'no_hf_adapter' has no Hugging Face conversion (TrainSpec.hf_adapter)"),
    ("build_validation_dataloader_fn", ["--validation.enabled"], 1,
     "model 'no_build_validation_dataloader_fn' has no build_validation_dataloader_fn, so validation.enabled must stay "
     "false"),
])
def test_an_option_the_family_does_not_provide_for_is_refused_before_start_up(missing, option, world, message):
    """The optional parts of a TrainSpec: a family without one refuses the option that needs it,
    naming the model, in the checks every rank runs before any process group."""
    name = f"no_{missing}"
    if name not in registered_names():
        register_train_spec(_spec(name, **{missing: None}))
    with pytest.raises(ConfigError) as e:
        preflight(parse_args(["--model.name", name, "--model.flavor", "tiny", *option]), world)
    assert str(e.value) == message
