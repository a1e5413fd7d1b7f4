"""float8.recipe: torchao's rowwise recipes beside tensorwise. What each recipe converts the linear
layers to, which TP styles and FSDP all-gather it may use, and the one-line refusals; the losses
under a layout are test_parity.py's (float8_rowwise_tp2_sp)."""

from __future__ import annotations

import pytest
from torch import nn

from torchtitan.config.manager import ConfigError, parse_args, read_config
from torchtitan.parallelisms.float8 import apply_float8, check_float8_support, float8_linear_config, uses_float8_tp_styles

pytest.importorskip("torchao.float8")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))


@pytest.mark.parametrize("recipe,granularity,grad_weight_fp8", [
    ("tensorwise", "tensorwise", True), ("rowwise", "axiswise", True), ("rowwise_with_gw_hp", "axiswise", False)])
def test_each_recipe_converts_to_its_torchao_config(recipe, granularity, grad_weight_fp8):
    config = parse_args(["--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe", recipe])
    model = _model()
    apply_float8(model, config)
    for linear in model:
        assert type(linear).__name__ == "Float8Linear"
        assert linear.config.cast_config_input.scaling_granularity.value == granularity
        assert linear.config.emulate is True
        # rowwise_with_gw_hp: the weight gradient's matmul in high precision (its operands not cast)
        assert (linear.config.cast_config_input_for_grad_weight.scaling_type.value != "disabled") == grad_weight_fp8
    assert uses_float8_tp_styles(config) == (recipe == "tensorwise")


def test_tensorwise_is_the_default_and_keeps_the_fsdp_float8_all_gather():
    config = parse_args(["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"])
    assert config.float8.recipe == "tensorwise"
    assert float8_linear_config("tensorwise", True).enable_fsdp_float8_all_gather is True


def test_a_rowwise_recipe_with_the_float8_all_gather_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        parse_args(["--float8.enable_float8_linear", "--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"])
    assert str(refused.value) == (
        "float8.enable_fsdp_float8_all_gather needs float8.recipe tensorwise (torchao all-gathers weights in float8 "
        "with one scale a tensor only); float8.recipe rowwise all-gathers them in high precision: drop one of the two")
    with pytest.raises(ConfigError, match="must be one of tensorwise, rowwise, rowwise_with_gw_hp"):
        parse_args(["--float8.recipe", "blockwise"])


def test_rowwise_under_tp_and_sp_runs_on_cpu_where_tensorwise_is_refused():
    """The rowwise recipes keep TP's plain styles, so no float8 tensor goes through gloo."""
    rowwise = parse_args(["--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe", "rowwise"])
    check_float8_support(rowwise, "cpu", tp_enabled=True)
    tensorwise = parse_args(["--float8.enable_float8_linear", "--float8.emulate"])
    with pytest.raises(ConfigError, match="sends float8 tensors through the TP collectives"):
        check_float8_support(tensorwise, "cpu", tp_enabled=True)


def test_only_llamas_plan_uses_the_float8_styles():
    """Qwen3's TP plan keeps the plain styles for every recipe: tensorwise TP with sequence
    parallelism runs on CPU for it."""
    qwen3 = parse_args(["--model.name", "qwen3", "--float8.enable_float8_linear", "--float8.emulate"])
    assert not uses_float8_tp_styles(qwen3)
    check_float8_support(qwen3, "cpu", tp_enabled=True)


def test_the_setup_record_names_the_recipe_that_ran():
    from torchtitan.observability.setup_record import _float8

    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        model = _model()
        apply_float8(model, parse_args(["--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe", recipe]))
        assert _float8(list(model.named_modules()), fsdp=False)["scaling"] == recipe


def test_rowwise_under_compile_rounds_casts_as_eager_does():
    import torch._inductor.config as inductor_config

    before = inductor_config.emulate_precision_casts
    try:
        inductor_config.emulate_precision_casts = False
        apply_float8(_model(), parse_args(["--float8.enable_float8_linear", "--float8.emulate", "--training.compile"]))
        assert inductor_config.emulate_precision_casts is False  # tensorwise: left alone
        apply_float8(_model(), parse_args(["--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe",
                                           "rowwise", "--training.compile"]))
        assert inductor_config.emulate_precision_casts is True
    finally:  # inductor's settings are the process's: the next tests get them as they were
        inductor_config.emulate_precision_casts = before


def test_a_recipe_without_float8_says_it_has_no_effect():
    config, notices = read_config(["--float8.recipe", "rowwise"])
    assert config.float8.enable_float8_linear is False
    assert notices == ["float8.recipe has no effect: it applies to float8.enable_float8_linear, and this job's linear "
                       "layers are not float8 (float8.enable_float8_linear is off)"]


def test_torchtitans_converters_and_quantize_section_are_read(tmp_path):
    """torchtitan's float8 configs of 2025: `model.converters` and `[quantize.linear.float8]`."""
    toml = tmp_path / "tt.toml"
    toml.write_text('[model]\nconverters = ["quantize.linear.float8"]\n[quantize.linear.float8]\n'
                    'recipe_name = "rowwise"\nfilter_fqns = ["output"]\nemulate = true\n')
    config, notices = read_config(["--job.config_file", str(toml)])
    assert (config.float8.enable_float8_linear, config.float8.recipe, config.float8.emulate) == (True, "rowwise", True)
    assert len(notices) == 4 and notices[0].startswith("model.converters ['quantize.linear.float8'] (torchtitan's "
                                                        "name) is read as float8.enable_float8_linear True")
    assert "quantize.linear.float8.filter_fqns is ignored" in notices[2]
    toml.write_text('[model]\nconverters = "float8"\n')  # early 2025: comma-separated text
    assert read_config(["--job.config_file", str(toml)])[0].float8.enable_float8_linear
    config, _ = read_config(["--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp"])
    assert config.float8.enable_float8_linear and config.float8.recipe == "rowwise_with_gw_hp"
    with pytest.raises(ConfigError, match="model.converters 'mx' is not supported: float8 is this version's only "
                                          "converter"):
        read_config(["--model.converters", "float8,mx"])
    assert read_config(["--model.converters", ""])[1] == ["model.converters [] (torchtitan's name) is ignored: it "
                                                           "converts nothing"]
    toml.write_text('[quantize.linear.mx]\nrecipe_name = "mxfp8"\n')
    with pytest.raises(ConfigError, match=r"unknown option quantize.linear.mx.recipe_name in .*: of \[quantize\] \(an "
                                          r"earlier version's section\), only quantize.linear.float8.recipe_name, "):
        read_config(["--job.config_file", str(toml)])
    with pytest.raises(ConfigError, match=r"unknown option --quantize.linear.mx.recipe_name: of \[quantize\]"):
        read_config(["--quantize.linear.mx.recipe_name", "mxfp8"])


def test_torchtitans_recipe_name_is_read_as_the_recipe(tmp_path):
    """torchtitan's option name (2025 on, and 0.3.0's) in a TOML or on the command line."""
    config, notices = read_config(["--float8.recipe_name", "rowwise"])
    assert config.float8.recipe == "rowwise"
    assert notices == ["float8.recipe_name 'rowwise' (torchtitan's name) is read as float8.recipe rowwise: the same "
                       "float8 scaling recipe"]
    toml = tmp_path / "f8.toml"
    toml.write_text('[float8]\nrecipe_name = "rowwise_with_gw_hp"\nrecipe = "rowwise"\n')
    with pytest.raises(ConfigError, match=r"float8.recipe_name 'rowwise_with_gw_hp' asks for float8.recipe "
                                          r"rowwise_with_gw_hp, but the file .* also sets float8.recipe rowwise; keep one"):
        read_config(["--job.config_file", str(toml)])
    with pytest.raises(ConfigError, match=r"float8.recipe_name must be one of rowwise, rowwise_with_gw_hp, tensorwise, "
                                          r"got 'mxfp8' \(it is read as float8.recipe\)"):
        read_config(["--float8.recipe_name", "mxfp8"])
    # The old name on the command line over the new one in the file: it wins, and says over what.
    toml.write_text('[float8]\nrecipe = "tensorwise"\nenable_float8_linear = true\nemulate = true\n')
    config, notices = read_config(["--job.config_file", str(toml), "--float8.recipe_name", "rowwise"])
    assert config.float8.recipe == "rowwise"
    assert notices == [f"float8.recipe_name 'rowwise' (torchtitan's name) is read as float8.recipe rowwise: the same "
                       f"float8 scaling recipe (over float8.recipe tensorwise in file {toml})"]
