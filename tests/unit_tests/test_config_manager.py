"""Tests for torchtitan.config.manager: merging defaults < TOML < CLI, errors, --help, shipped configs."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config.manager import ConfigError, JobConfig, help_text, main, parse_args, validate_world_size

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_launcher_world_size(monkeypatch):
    # main() also checks the parallel degrees when the launcher exports WORLD_SIZE.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def write_toml(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------------------------- merging


def test_defaults_when_no_args():
    config = parse_args([])
    assert config == JobConfig()
    assert config.training.steps == 10000
    assert config.optimizer.name == "AdamW"
    assert config.optimizer.lr == pytest.approx(8e-4)
    assert config.metrics.enable_tensorboard is False
    assert config.experimental.pipeline_parallel_split_points == []


def test_list_defaults_are_not_shared_between_configs():
    a, b = JobConfig(), JobConfig()
    a.experimental.pipeline_parallel_split_points.append("layers.1")
    assert b.experimental.pipeline_parallel_split_points == []


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\nwarmup_steps = 2\nseq_len = 64\n[optimizer]\nlr = 1e-3\nname = 'Adam'\n")
    from_toml = parse_args(["--job.config_file", path])
    assert (from_toml.training.steps, from_toml.training.seq_len) == (7, 64)
    assert from_toml.optimizer.lr == pytest.approx(1e-3)
    assert from_toml.optimizer.name == "Adam"
    assert from_toml.training.batch_size == JobConfig().training.batch_size  # untouched default

    # The CLI wins whatever the order of --job.config_file among the options.
    for argv in (["--job.config_file", path, "--training.steps", "9"], ["--training.steps", "9", "--job.config_file", path]):
        merged = parse_args(argv)
        assert merged.training.steps == 9
        assert merged.training.seq_len == 64
        assert merged.optimizer.lr == pytest.approx(1e-3)


def test_space_and_equals_forms():
    assert parse_args(["--training.steps", "500"]).training.steps == 500
    assert parse_args(["--training.steps=600"]).training.steps == 600
    assert parse_args(["--optimizer.lr=0.5"]).optimizer.lr == pytest.approx(0.5)
    assert parse_args(["--job.description", "hello world"]).job.description == "hello world"


def test_bool_forms():
    assert parse_args(["--metrics.enable_tensorboard"]).metrics.enable_tensorboard is True
    assert parse_args(["--metrics.enable_tensorboard", "false"]).metrics.enable_tensorboard is False
    assert parse_args(["--metrics.enable_tensorboard=true"]).metrics.enable_tensorboard is True
    assert parse_args(["--metrics.rank_0_only", "false"]).metrics.rank_0_only is False
    # A bare flag followed by another option does not swallow it.
    config = parse_args(["--metrics.enable_tensorboard", "--training.steps", "300"])
    assert config.metrics.enable_tensorboard is True and config.training.steps == 300


def test_list_option_from_cli_and_toml(tmp_path):
    cli = parse_args(["--experimental.pipeline_parallel_split_points", "layers.2,layers.4"])
    assert cli.experimental.pipeline_parallel_split_points == ["layers.2", "layers.4"]
    path = write_toml(tmp_path, '[experimental]\npipeline_parallel_split_points = ["layers.1", "layers.3"]\n')
    toml = parse_args(["--job.config_file", path])
    assert toml.experimental.pipeline_parallel_split_points == ["layers.1", "layers.3"]


# ----------------------------------------------------------------------------- errors

BAD_CLI = [
    (["--trainng.steps", "3"], ["training", "did you mean"]),
    (["--training.stpes", "3"], ["'steps'", "did you mean"]),
    (["--training.steps", "abc"], ["training.steps", "integer"]),
    (["--training.steps"], ["training.steps"]),
    (["--metrics.enable_tensorboard", "maybe"], ["metrics.enable_tensorboard"]),
    (["--optimizer.name", "SGD"], ["optimizer.name", "SGD"]),
    (["--job.config_file", "/nonexistent/dir/job.toml"], ["/nonexistent/dir/job.toml"]),
    (["--optimizer.lr", "0"], ["optimizer.lr"]),
    (["--optimizer.lr", "-1"], ["optimizer.lr"]),
    (["--optimizer.lr", "-1e-3"], ["optimizer.lr must be > 0"]),  # negative number, not an option
    (["--training.seq_len", "0"], ["training.seq_len"]),
    (["--training.steps", "0"], ["training.steps"]),
    (["--training.batch_size", "0"], ["training.batch_size"]),
    (["--training.data_parallel_shard_degree", "-2"], ["training.data_parallel_shard_degree"]),
    (["--training.data_parallel_shard_degree", "0"], ["training.data_parallel_shard_degree"]),
    (["--experimental.enable_async_tensor_parallel"], ["enable_async_tensor_parallel needs training.tensor_parallel_degree > 1"]),
    (["--experimental.enable_async_tensor_parallel", "--training.tensor_parallel_degree", "2"],
     ["enable_async_tensor_parallel", "set training.compile true"]),
    (["--float8.enable_fsdp_float8_all_gather"], ["need float8.enable_float8_linear"]),
    (["--float8.enable_float8_linear", "--float8.precompute_float8_dynamic_scale_for_fsdp"],
     ["precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather"]),
    (["--training.ddp_bucket_cap_mb", "0"], ["training.ddp_bucket_cap_mb must be >= 1"]),
    (["stray"], ["stray"]),
    (["--checkpoint.keep_latest_k", "-1"], ["checkpoint.keep_latest_k must be >= 0"]),
    (["--checkpoint.enable_checkpoint", "--checkpoint.load_step", "-2"], ["checkpoint.load_step must be a step number"]),
    (["--checkpoint.load_step", "5"], ["checkpoint.load_step needs checkpoint.enable_checkpoint"]),
    (["--checkpoint.export_dtype", "bfloat16"], ["checkpoint.export_dtype bfloat16 applies to the weights-only",
                                                  "checkpoint.model_weights_only"]),
    (["--checkpoint.async_mode", "sometimes"], ["checkpoint.async_mode", "disabled, async, async_with_pinned_mem"]),
    (["--checkpoint.interval", "0"], ["checkpoint.interval must be >= 1"]),
    (["--training.warmup_steps", "-1"], ["training.warmup_steps must be >= 0, got -1"]),
    (["--moe.aux_loss_coef", "-0.5"], ["moe.aux_loss_coef and moe.bias_update_rate must be >= 0", "got -0.5 and"]),
    (["--moe.bias_update_rate", "-1"], ["moe.aux_loss_coef and moe.bias_update_rate must be >= 0", "and -1.0"]),
    (["--moe.capacity_factor", "-1.25"], ["moe.capacity_factor must be > 0 to drop tokens, or 0", "got -1.25"]),
    (["--moe.capacity_factor", "1.25", "--training.tensor_parallel_degree", "2"],
     ["moe.capacity_factor 1.25 drops tokens per whole sequence", "training.tensor_parallel_degree 2"]),
    (["--moe.capacity_factor", "1.25", "--experimental.context_parallel_degree", "2"],
     ["moe.capacity_factor 1.25", "experimental.context_parallel_degree 2", "set both to 1"]),
    (["--profiling.enable_profiling", "--profiling.profile_freq", "1"], ["profiling.profile_freq must be >= 2"]),
    (["--profiling.audit_host_reads", "--training.compile"], ["profiling.audit_host_reads", "training.compile"]),
    (["--job.dry_run", "--job.dry_run_vocab_size", "-1"], ["job.dry_run_vocab_size must be a number of tokens", "got -1"]),
    (["--job.dry_run", "--job.dry_run_rank", "-2"], ["job.dry_run_rank must be a rank, or -1", "got -2"]),
]

BAD_TOML = [
    ("[training]\nstpes = 3\n", ["training.stpes", "'steps'"]),
    ("[trainng]\nsteps = 3\n", ["trainng", "'training'"]),
    ('[training]\nsteps = "ten"\n', ["training.steps", "ten"]),
    ("[training]\nsteps = 3.5\n", ["training.steps"]),
    ("[metrics]\nenable_tensorboard = 1\n", ["metrics.enable_tensorboard"]),
    ("[experimental]\npipeline_parallel_split_points = [1, 2]\n", ["pipeline_parallel_split_points"]),
    ('[optimizer]\nname = "SGD"\n', ["optimizer.name", "SGD"]),
    ("steps = 3\n[training]\nseq_len = 8\n", ["steps", "table"]),
    ("[training]\nsteps = 0\n", ["training.steps"]),
    ('[training]\nsteps = "10"\n', ["training.steps", "not the string '10'"]),  # TOML values are typed
    ('[metrics]\nenable_tensorboard = "yes"\n', ["metrics.enable_tensorboard", "true or false"]),
    ('[experimental]\npipeline_parallel_split_points = "layers.1"\n',  # a list option given one string
     ["experimental.pipeline_parallel_split_points (", "must be a list, got 'layers.1'"]),
    ("[training]\nsteps = true\n", ["training.steps (", "must be an integer, got True"]),  # a TOML bool is no int
]


def assert_one_line_error(capsys, argv, fragments):
    with pytest.raises(ConfigError) as raised:
        parse_args(argv)
    for fragment in fragments:
        assert fragment in str(raised.value)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize("argv,fragments", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_cli_input(capsys, argv, fragments):
    assert_one_line_error(capsys, argv, fragments)


@pytest.mark.parametrize("text,fragments", BAD_TOML)
def test_bad_toml_input(tmp_path, capsys, text, fragments):
    assert_one_line_error(capsys, ["--job.config_file", write_toml(tmp_path, text)], fragments)


def test_malformed_toml_names_the_line(tmp_path, capsys):
    path = write_toml(tmp_path, "[training]\nsteps = 3\nseq_len = = 4\n")
    assert_one_line_error(capsys, ["--job.config_file", path], [path])
    with pytest.raises(ConfigError) as raised:
        parse_args(["--job.config_file", path])
    assert re.search(r"line\D{0,3}3\b", str(raised.value)), str(raised.value)


def test_config_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[training]\n")
    assert_one_line_error(capsys, ["--job.config_file", str(path)], [str(path), "UTF-8"])


def test_config_file_that_is_a_directory(tmp_path, capsys):
    assert_one_line_error(capsys, ["--job.config_file", str(tmp_path)], [str(tmp_path)])


def assert_one_line_error_from_main(capsys, argv, fragments):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    for fragment in fragments:
        assert fragment in err


def test_main_checks_degrees_against_launcher_world_size(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([]) == 0
    assert main(["--training.data_parallel_shard_degree", "4"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert_one_line_error_from_main(capsys, ["--training.data_parallel_shard_degree", "2"], ["world size 3"])


def test_main_accepts_every_data_parallel_layout(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--training.data_parallel_replicate_degree", "4"]) == 0  # dp_shard -1 -> 1: DDP
    assert main(["--training.data_parallel_replicate_degree", "2"]) == 0  # HSDP 2 x 2
    assert main(["--training.data_parallel_shard_degree", "4", "--training.enable_cpu_offload",
                 "--training.fsdp_reshard_after_forward", "never", "--training.defer_sharded_gradient_reduction",
                 "--training.gradient_accumulation_steps", "2"]) == 0  # FSDP 4
    assert main(["--training.data_parallel_replicate_degree", "4", "--training.mixed_precision_reduce", "bfloat16",
                 "--training.compile"]) == 0  # DDP with bf16 all-reduce
    # bf16 compute without FSDP: autocast (parallelisms/mixed_precision.py), on one rank and under DDP.
    assert main(["--training.data_parallel_replicate_degree", "4", "--training.mixed_precision_param", "bfloat16"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--training.mixed_precision_param", "bfloat16"]) == 0


# Options only FSDP can honour, on layouts that cannot honour them: (world size, argv, fragments of the line).
FSDP_ONLY = [
    (2, ["--training.data_parallel_replicate_degree", "2", "--training.enable_cpu_offload"],
     ["training.enable_cpu_offload", "data_parallel_shard_degree > 1", "is DDP"]),
    (1, ["--training.enable_cpu_offload"], ["training.enable_cpu_offload", "no FSDP"]),
    (2, ["--training.data_parallel_replicate_degree", "2", "--training.fsdp_reshard_after_forward", "never"],
     ["training.fsdp_reshard_after_forward 'never' applies to FSDP only", "is DDP"]),
    (1, ["--training.mixed_precision_reduce", "bfloat16"], ["training.mixed_precision_reduce", "one rank"]),
    (2, ["--training.data_parallel_replicate_degree", "2", "--training.defer_sharded_gradient_reduction"],
     ["training.defer_sharded_gradient_reduction", "is DDP", "leave it off"]),
    (4, ["--training.data_parallel_shard_degree", "2", "--experimental.pipeline_parallel_degree", "2",
         "--training.defer_sharded_gradient_reduction"], ["defer_sharded_gradient_reduction", "pipeline parallelism"]),
]


@pytest.mark.parametrize("world,argv,fragments", FSDP_ONLY, ids=[" ".join(a) for _, a, _ in FSDP_ONLY])
def test_main_refuses_fsdp_options_without_fsdp(monkeypatch, capsys, world, argv, fragments):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert_one_line_error_from_main(capsys, argv, fragments)


@pytest.mark.parametrize("world,argv", [(2, []), (4, ["--training.data_parallel_shard_degree", "4"]),
                                        (4, ["--training.tensor_parallel_degree", "2"])])
def test_main_refuses_zero1_without_replicas(monkeypatch, capsys, world, argv):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert_one_line_error_from_main(capsys, [*argv, "--optimizer.zero1"],
                                    ["optimizer.zero1", "data_parallel_replicate_degree is 1"])


def test_main_accepts_zero1_with_replicas(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    for argv in (["--training.data_parallel_replicate_degree", "8"],  # DDP
                 ["--training.data_parallel_replicate_degree", "2", "--experimental.context_parallel_degree", "2"],
                 ["--training.data_parallel_replicate_degree", "2", "--training.tensor_parallel_degree", "2"]):
        assert main([*argv, "--optimizer.zero1"]) == 0, argv


def test_main_refuses_seed_checkpoint_on_several_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--checkpoint.create_seed_checkpoint"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_one_line_error_from_main(capsys, ["--checkpoint.create_seed_checkpoint"], ["one process", "NGPU=1"])


# ----------------------------------------------------------------------------- help


def test_help_lists_sections_options_and_defaults(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse line wrapping
    for f in dataclasses.fields(JobConfig):
        assert f"[{f.name}]" in out
    assert "--training.steps" in out
    assert "default: 10000" in out
    assert "--optimizer.name" in out and "default: 'AdamW'" in out
    assert "--training.decay_type" in out and "choices: linear, cosine, constant" in out
    assert main(["-h"]) == 0


def test_help_text_names_every_field():
    text = help_text()
    defaults = JobConfig()
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(getattr(defaults, section.name)):
            option = f"--{section.name}.{f.name}"
            assert re.search(re.escape(option) + r"(?![\w.])", text), option


# ----------------------------------------------------------------------------- shipped files, imports


def test_shipped_train_configs_parse():
    paths = sorted((REPO_ROOT / "train_configs").glob("*.toml"))
    assert paths
    for path in paths:
        config = parse_args(["--job.config_file", str(path)])
        assert isinstance(config, JobConfig)


def test_config_manager_does_not_import_torch():
    code = "import sys, torchtitan.config.manager; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- late-2024 torchtitan options


def test_late_2024_metrics_optimizer_and_float8_options_are_accepted(tmp_path):
    """The options of torchtitan's December 2024 schema that this one gained later, as its configs set them."""
    text = """
[metrics]
log_freq = 1
enable_color_printing = true
enable_tensorboard = false
enable_wandb = false
[optimizer]
name = "AdamW"
early_step_in_backward = false
[float8]
enable_float8_linear = false
scaling_type_input = "dynamic"
scaling_type_weight = "dynamic"
scaling_type_grad_output = "dynamic"
"""
    config = parse_args(["--job.config_file", write_toml(tmp_path, text)])
    assert config.metrics.enable_color_printing is True and config.metrics.enable_wandb is False
    assert config.float8.scaling_type_grad_output == "dynamic"


@pytest.mark.parametrize("key", ["scaling_type_input", "scaling_type_weight", "scaling_type_grad_output"])
def test_float8_delayed_scaling_is_refused_by_value(key):
    with pytest.raises(ConfigError, match=rf"^float8.{key} 'delayed' is not supported: .*use 'dynamic'$"):
        parse_args([f"--float8.{key}", "delayed"])
    with pytest.raises(ConfigError, match="must be one of dynamic, delayed"):
        parse_args([f"--float8.{key}", "static"])


def test_peak_tflops_must_not_be_negative():
    assert parse_args(["--metrics.peak_tflops", "989"]).metrics.peak_tflops == 989.0
    with pytest.raises(ConfigError, match="metrics.peak_tflops must be >= 0"):
        parse_args(["--metrics.peak_tflops", "-1"])


EARLY = ["--optimizer.early_step_in_backward", "--training.max_norm", "0"]
EARLY_REFUSED = [
    (["--optimizer.early_step_in_backward"], "set training.max_norm 0"),  # clipping is on by default
    ([*EARLY, "--training.gradient_accumulation_steps", "2"], "training.gradient_accumulation_steps 1"),
    ([*EARLY, "--experimental.pipeline_parallel_degree", "2"], "experimental.pipeline_parallel_degree 1"),
    ([*EARLY, "--optimizer.zero1", "--training.data_parallel_replicate_degree", "2"], "optimizer.zero1"),
    # What can never compose is named before the settings to change (max_norm is 1 by default).
    (["--optimizer.early_step_in_backward", "--optimizer.name", "Muon"], "does not compose with optimizer.name Muon"),
    (["--optimizer.early_step_in_backward", "--training.data_parallel_replicate_degree", "2",
      "--training.data_parallel_shard_degree", "1"], "does not compose with DDP"),
    (["--optimizer.early_step_in_backward", "--experimental.pipeline_parallel_degree", "2"], "pipeline parallelism"),
]


@pytest.mark.parametrize("argv,fragment", EARLY_REFUSED,
                         ids=["max_norm", "accumulation", "pp", "zero1", "muon first", "ddp first", "pp first"])
def test_early_step_in_backward_refuses_what_cannot_compose(argv, fragment):
    # A layout rule (DDP is known once the world size is): every job meets it in the pre-check or preflight.
    with pytest.raises(ConfigError, match="^optimizer.early_step_in_backward") as raised:
        validate_world_size(parse_args(argv), 2)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_early_step_in_backward_needs_fsdp_not_ddp(monkeypatch, capsys):
    assert parse_args(EARLY).optimizer.early_step_in_backward is True
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(EARLY) == 0  # FSDP 4
    assert main([*EARLY, "--training.data_parallel_replicate_degree", "2"]) == 0  # HSDP 2 x 2
    # DDP with TP is FSDP's replicate, which steps after the all-reduce too.
    assert main([*EARLY, "--training.data_parallel_replicate_degree", "2", "--training.tensor_parallel_degree", "2"]) == 0
    capsys.readouterr()
    assert main([*EARLY, "--training.data_parallel_replicate_degree", "4"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.early_step_in_backward does not compose with DDP" in err and len(err.strip().splitlines()) == 1


def test_warm_up_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"training.warmup_steps 200 is longer than the run \(training.steps 50\)"):
        parse_args(["--training.steps", "50"])
    assert parse_args(["--training.steps", "50", "--training.warmup_steps", "50"]).training.steps == 50


def test_late_2024_spellings_are_accepted(tmp_path):
    path = write_toml(tmp_path, "[training]\nenable_loss_parallel = false\n[model]\nnorm_type = 'fused_rmsnorm'\n")
    config = parse_args(["--job.config_file", path])
    assert config.training.enable_loss_parallel is False and config.model.norm_type == "fused_rmsnorm"
    from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config

    assert not parallel_dims_from_config(config, 2).loss_parallel_enabled  # without TP it is off anyway
    config.training.tensor_parallel_degree = 2
    assert not parallel_dims_from_config(config, 2).loss_parallel_enabled
    config.training.enable_loss_parallel = True
    assert parallel_dims_from_config(config, 2).loss_parallel_enabled


@pytest.mark.parametrize("args,message", [
    (["--validation.freq", "0"], "validation.freq must be >= 1, got 0"),
    (["--validation.steps", "0"], "validation.steps must be >= 1 or -1 (the whole validation data), got 0"),
    (["--validation.batch_size", "-2"], "validation.batch_size must be >= 1 or -1 (the rows of one optimizer step: "
                                        "training.batch_size x training.gradient_accumulation_steps), got -2"),
    (["--validation.held_out_fraction", "1"], "validation.held_out_fraction must lie strictly between 0 and 1, got 1.0"),
    (["--validation.held_out_fraction", "0"], "validation.held_out_fraction must lie strictly between 0 and 1, got 0.0"),
    (["--validation.enabled", "--validation.batch_size", "12", "--training.batch_size", "8",
      "--experimental.pipeline_parallel_degree", "2"],
     "validation.batch_size 12 must be a multiple of training.batch_size 8 under pipeline parallelism (or -1)"),
])
def test_validation_options_are_checked(args, message):
    with pytest.raises(ConfigError) as raised:
        parse_args(args)
    assert str(raised.value) == message


def test_validation_defaults_are_off_and_sensible():
    v = parse_args([]).validation
    assert not v.enabled and v.freq >= 1 and v.steps >= 1 and 0 < v.held_out_fraction < 1 and v.batch_size == -1
    assert parse_args(["--validation.enabled", "--validation.steps", "-1"]).validation.steps == -1


@pytest.mark.parametrize("option", [["--checkpoint.initial_load_path", "some/hf_folder"], ["--checkpoint.last_save_in_hf"]])
def test_a_seed_checkpoint_neither_loads_nor_exports(option):
    """A seed checkpoint is freshly initialised weights: a folder to start from or an export at
    the end would be ignored without a word."""
    with pytest.raises(ConfigError, match=rf"checkpoint.create_seed_checkpoint writes freshly initialised weights and "
                                          rf"trains nothing; leave checkpoint.{option[0].split('.')[-1]} unset"):
        parse_args(["--checkpoint.create_seed_checkpoint", *option])


def test_a_world_size_that_is_not_a_number_of_ranks_is_one_line(capsys, monkeypatch):
    # Found by the config fuzzing (test_config_fuzz.py): the pre-check read WORLD_SIZE with int(),
    # a traceback for 'abc'.
    for text in ("abc", "0", "-2", "1e3", " 4", "٣"):
        monkeypatch.setenv("WORLD_SIZE", text)
        assert main([]) == 2
        assert capsys.readouterr().err == (f"error: WORLD_SIZE must be the number of ranks the job starts (1 or "
                                           f"more), got {text!r}\n")



@pytest.mark.parametrize("argv,line", [
    # Found by the config fuzzing (test_config_fuzz.py): each was a torch traceback in preflight.
    (["--training.loss_chunk_size", str(2**63)], "training.loss_chunk_size (command line) must fit in 64 bits (at most "
     f"{2**63 - 1}), got {2**63}"),
    (["--training.seed", str(-2**63 - 1)], f"training.seed (command line) must fit in 64 bits (at most {2**63 - 1}), "
     f"got {-2**63 - 1}"),
    (["--training.seq_len", str(2**63 - 1)], f"training.seq_len {2**63 - 1} is beyond the longest sequence this "
     "version takes (2,147,483,648 tokens)"),
    (["--model.vocab_size_divisible_by", str(2**40)], f"model.vocab_size_divisible_by {2**40} would pad the "
     "vocabulary by up to as many rows; at most 1,048,576 (a multiple of the TP degree is enough)"),
])
def test_sizes_torch_cannot_hold_are_refused_when_parsed(argv, line, tmp_path):
    with pytest.raises(ConfigError) as refused:
        parse_args(argv)
    assert refused.value.line == f"error: {line}"
    path = write_toml(tmp_path, f"[training]\nloss_chunk_size = {2**63}\n")
    with pytest.raises(ConfigError, match=rf"loss_chunk_size \({path}\) must fit in 64 bits"):
        parse_args(["--job.config_file", path])


def test_a_config_file_that_never_ends_is_one_line():
    # Found by the config fuzzing (test_config_fuzz.py): the whole file was read, and /dev/zero filled
    # the memory. In a process of its own under a 2 GiB address-space limit, should it come back.
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from torchtitan.config.manager import main; sys.exit(main(['--job.config_file', '/dev/zero']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, "error: config file /dev/zero holds more than 16 MiB: not a "
                                                     "TOML config (set --job.config_file)\n")
