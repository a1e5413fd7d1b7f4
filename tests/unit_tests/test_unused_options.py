"""Options a job sets that have no effect (torchtitan/config/unused_options.py): torchtitan's own
late-2024 configs run again, each old option gets one notice line or a one-line refusal, options of
a feature the job does not use get a notice, and a job says each notice once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers import run_train
from torchtitan.config.manager import ConfigError, main, parse_args, read_config
from torchtitan.config.unused_options import APPLIES_ONLY_WITH, LEGACY
from torchtitan.errors import UserError

# The options torchtitan's own configs set in December 2024 (train_configs/ of its repository then),
# with their values: the debug model's in full, the Llama 3 recipes as what they set differently.
DEBUG_2024 = {
    "job": {"dump_folder": "./outputs", "description": "Llama 3 debug training", "print_args": False,
            "use_for_integration_test": True},
    "profiling": {"enable_profiling": False, "save_traces_folder": "profile_trace", "profile_freq": 10,
                  "enable_memory_snapshot": False, "save_memory_snapshot_folder": "memory_snapshot"},
    "metrics": {"log_freq": 1, "disable_color_printing": False, "enable_tensorboard": False, "save_tb_folder": "tb",
                "enable_wandb": False},
    "model": {"name": "llama3", "flavor": "debugmodel", "norm_type": "rmsnorm",
              "tokenizer_path": "./tests/assets/test_tiktoken.model"},
    "optimizer": {"name": "AdamW", "lr": 8e-4},
    "training": {"batch_size": 8, "seq_len": 2048, "warmup_steps": 2, "max_norm": 1.0, "steps": 10,
                 "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1, "tensor_parallel_degree": 1,
                 "compile": False, "dataset": "c4_test"},
    "experimental": {"context_parallel_degree": 1, "pipeline_parallel_degree": 1, "enable_async_tensor_parallel": False},
    "checkpoint": {"enable_checkpoint": False, "folder": "checkpoint", "interval_type": "steps", "interval": 10,
                   "model_weights_only": False, "export_dtype": "float32", "async_mode": "disabled"},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"},
    "float8": {"enable_float8_linear": False},
}
_RECIPE = {"job": {"description": "Llama 3 training"}, "profiling": {"enable_profiling": True, "profile_freq": 100},
           "metrics": {"log_freq": 10, "enable_tensorboard": True},
           "model": {"tokenizer_path": "./torchtitan/datasets/tokenizer/original/tokenizer.model"},
           "training": {"warmup_steps": 200, "steps": 1000, "seq_len": 8192, "dataset": "c4"},
           "checkpoint": {"interval": 500}}
_NOT_IN_RECIPES = {"job": ("print_args", "use_for_integration_test"), "metrics": ("disable_color_printing", "enable_wandb"),
                   "profiling": ("enable_memory_snapshot", "save_memory_snapshot_folder"),
                   "experimental": ("enable_async_tensor_parallel",)}
# name: (world size it was written for, what it sets beyond the shared recipe)
RECIPES_2024 = {
    "llama3_8b": (8, {"model": {"flavor": "8B"}, "optimizer": {"lr": 3e-4}, "training": {"batch_size": 1},
                      "activation_checkpoint": {"selective_ac_option": "op"}}),
    "llama3_70b": (64, {"model": {"flavor": "70B"}, "optimizer": {"lr": 1.5e-4},
                        "training": {"tensor_parallel_degree": 8}, "activation_checkpoint": {"mode": "full"}}),
    "llama3_405b": (128, {"model": {"flavor": "405B"}, "optimizer": {"lr": 8e-5},
                          "training": {"batch_size": 2, "warmup_steps": 600, "steps": 3000, "tensor_parallel_degree": 8,
                                       "compile": True},
                          "experimental": {"enable_async_tensor_parallel": True},
                          "activation_checkpoint": {"mode": "full"},
                          "float8": {"enable_fsdp_float8_all_gather": True,
                                     "precompute_float8_dynamic_scale_for_fsdp": True, "enable_float8_linear": True}}),
}


def recipe_2024(name: str) -> dict:
    sections = {s: {k: v for k, v in values.items() if k not in _NOT_IN_RECIPES.get(s, ())}
                for s, values in DEBUG_2024.items()}
    for changes in (_RECIPE, RECIPES_2024[name][1]):
        for section, values in changes.items():
            sections[section].update(values)
    if sections["activation_checkpoint"]["mode"] == "full":
        del sections["activation_checkpoint"]["selective_ac_option"]
    return sections


def write_toml(path: Path, sections: dict) -> str:
    def value(v):
        return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, (int, float)) else f'"{v}"'

    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in values.items()) + "\n"
                            for s, values in sections.items()))
    return str(path)


INTEGRATION_NOTICE = ("notice: job.use_for_integration_test is ignored: it marked torchtitan's own integration-test "
                      "configs and has no effect on a run")
INTERVAL_NOTICE = "notice: checkpoint.interval_type 'steps' is ignored: checkpoint.interval always counts steps in this version"


def test_the_late_2024_debug_config_passes_the_pre_check_with_one_notice_each(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = write_toml(tmp_path / "debug_model.toml", DEBUG_2024)
    assert main(["--job.config_file", path]) == 0
    assert capsys.readouterr().err.splitlines() == [INTEGRATION_NOTICE, INTERVAL_NOTICE]
    config, _ = read_config(["--job.config_file", path])
    assert (config.training.dataset, config.checkpoint.interval, config.metrics.log_freq) == ("c4_test", 10, 1)


@pytest.mark.parametrize("name", RECIPES_2024)
def test_the_late_2024_recipes_pass_the_pre_check_at_their_world_size(name, tmp_path, capsys, monkeypatch):
    world_size, sets = RECIPES_2024[name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    path = write_toml(tmp_path / f"{name}.toml", recipe_2024(name))
    assert main(["--job.config_file", path]) == 0
    assert capsys.readouterr().err.splitlines() == [INTERVAL_NOTICE]
    assert parse_args(["--job.config_file", path]).model.flavor == sets["model"]["flavor"]


def test_the_late_2024_debug_config_names_its_missing_tokenizer_in_one_line(tmp_path):
    # The files it names live in torchtitan's repository: preflight stops at the first, in one line.
    from torchtitan.config.preflight import preflight

    path = write_toml(tmp_path / "debug_model.toml", DEBUG_2024)
    config = parse_args(["--job.config_file", path, "--job.dump_folder", str(tmp_path / "out")])
    with pytest.raises(UserError) as refused:
        preflight(config, world_size=1, device_type="cpu")
    assert refused.value.line == ("error: tokenizer file not found: ./tests/assets/test_tiktoken.model "
                                  "(set --model.tokenizer_path)")


@pytest.mark.parametrize("option,value,line", [
    ("job.use_for_integration_test", "false", INTEGRATION_NOTICE),
    ("checkpoint.interval_type", "steps", INTERVAL_NOTICE),
    ("experimental.context_parallel_rotate_method", "allgather",
     "notice: experimental.context_parallel_rotate_method 'allgather' (the late-2024 name) is read as "
     "experimental.context_parallel_method allgather: the same exchange of keys and values between context-parallel ranks"),
    ("checkpoint.interval_type", "seconds",
     "error: checkpoint.interval_type 'seconds' is not supported: checkpoint.interval counts steps in this version, "
     "so its value would be read as steps; give the interval in steps and delete checkpoint.interval_type"),
    ("experimental.context_parallel_rotate_method", "gather",
     "error: experimental.context_parallel_rotate_method must be allgather or alltoall, got 'gather' (it is read as "
     "experimental.context_parallel_method: allgather, or ring for alltoall)"),
])
@pytest.mark.parametrize("through", ["toml", "command line"])
def test_each_old_option_gets_one_line(option, value, line, through, tmp_path, capsys):
    section, key = option.split(".")
    if through == "toml":
        toml_value = value if value in ("true", "false") else f'"{value}"'
        argv = ["--job.config_file", write_toml(tmp_path / "old.toml", {})]
        Path(argv[1]).write_text(f"[{section}]\n{key} = {toml_value}\n")
    else:
        argv = [f"--{option}", value]
    assert main(argv) == (2 if line.startswith("error:") else 0)
    assert capsys.readouterr().err == line + "\n"


def test_rotate_method_sets_the_context_parallel_method_it_names(tmp_path):
    assert parse_args(["--experimental.context_parallel_rotate_method", "alltoall",
                       "--experimental.context_parallel_method", "ring"]).experimental.context_parallel_method == "ring"
    config, notices = read_config(["--experimental.context_parallel_rotate_method", "allgather"])
    assert config.experimental.context_parallel_method == "allgather" and len(notices) == 1
    # Two names for one setting: one source naming both differently is refused; the command line
    # overrides the file, as for any option.
    path = write_toml(tmp_path / "cp.toml", {"experimental": {"context_parallel_rotate_method": "allgather"}})
    with pytest.raises(ConfigError, match=r"context_parallel_rotate_method 'alltoall' asks for "
                       r"experimental.context_parallel_method ring, but the command line also sets "
                       r"experimental.context_parallel_method allgather; keep one of the two"):
        parse_args(["--experimental.context_parallel_rotate_method", "alltoall",
                    "--experimental.context_parallel_method", "allgather"])
    config, notices = read_config(["--job.config_file", path, "--experimental.context_parallel_method", "ring"])
    assert config.experimental.context_parallel_method == "ring"
    assert notices == [f"experimental.context_parallel_rotate_method 'allgather' in {path} is overridden by "
                       "--experimental.context_parallel_method ring"]
    both = write_toml(tmp_path / "both.toml", {"experimental": {"context_parallel_rotate_method": "alltoall",
                                                                "context_parallel_method": "allgather"}})
    with pytest.raises(ConfigError, match=f"but the file {both} also sets"):
        parse_args(["--job.config_file", both])


def test_an_old_option_of_the_wrong_type_is_refused_like_any_option():
    with pytest.raises(ConfigError, match=r"job.use_for_integration_test \(command line\) must be true or false"):
        parse_args(["--job.use_for_integration_test", "maybe"])


def test_help_lists_no_old_option(capsys):
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "job.dump_folder" in help_text and not any(option in help_text for option in LEGACY)


@pytest.mark.parametrize("argv,line", [
    (["--optimizer.muon_ns_steps", "9"], "optimizer.muon_ns_steps has no effect: it applies to optimizer.name Muon, "
     "and this job's optimizer is AdamW"),
    (["--optimizer.name", "Adam", "--optimizer.muon_momentum", "0.9", "--optimizer.muon_exclude", "output"],
     "optimizer.muon_momentum, optimizer.muon_exclude have no effect: they apply to optimizer.name Muon, and this "
     "job's optimizer is Adam"),
    (["--fault_tolerance.sync_steps", "3"], "fault_tolerance.sync_steps has no effect: it applies to "
     "fault_tolerance.semi_sync_method local_sgd or diloco, and this job has no replica groups (fault_tolerance.enable "
     "is off)"),
    (["--fault_tolerance.outer_momentum", "0.5"], "fault_tolerance.outer_momentum has no effect: it applies to "
     "fault_tolerance.semi_sync_method diloco, and this job has no replica groups (fault_tolerance.enable is off)"),
])
def test_options_of_a_feature_the_job_does_not_use_get_a_notice(argv, line):
    config, notices = read_config(argv)
    assert notices == [line]


def test_options_of_the_feature_in_use_and_defaults_get_no_notice():
    assert read_config(["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "9"])[1] == []
    assert read_config([])[1] == []
    assert {rule.options for rule in APPLIES_ONLY_WITH} >= {"optimizer.muon_*", "fault_tolerance.sync_steps"}


def test_semi_sync_notices_name_what_the_groups_do(monkeypatch):
    # With replica groups, sync_steps is read by local_sgd and diloco only (the every-step mode averages gradients).
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "localhost:29510")
    pytest.importorskip("torchft")
    _, notices = read_config(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                              "--fault_tolerance.sync_steps", "3", "--fault_tolerance.outer_lr", "0.5",
                              "--fault_tolerance.semi_sync_method", "local_sgd"])
    assert notices == ["fault_tolerance.outer_lr has no effect: it applies to fault_tolerance.semi_sync_method diloco, "
                       "and this job's semi_sync_method is local_sgd"]
    _, notices = read_config(["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
                              "--fault_tolerance.sync_steps", "3"])
    assert notices == ["fault_tolerance.sync_steps has no effect: it applies to fault_tolerance.semi_sync_method "
                       "local_sgd or diloco, and this job's semi_sync_method is none (the groups average gradients "
                       "every step)"]


@pytest.mark.parametrize("rank,shown", [("0", 1), ("1", 0)])
def test_a_rank_logs_notices_only_as_rank_0(rank, shown, monkeypatch, caplog):
    monkeypatch.setenv("RANK", rank)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        parse_args(["--job.use_for_integration_test"])
    assert [r.getMessage() for r in caplog.records] == [INTEGRATION_NOTICE] * shown


def test_the_launchers_pre_check_leaves_the_notices_to_rank_0(capsys, monkeypatch):
    # run_llama_train.sh asks with --launch-mode on every node; rank 0 alone then says each notice.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--launch-mode", "--job.use_for_integration_test"]) == 0
    assert capsys.readouterr() == ("torchrun\n", "")
    assert main(["--job.use_for_integration_test"]) == 0
    assert capsys.readouterr().err == INTEGRATION_NOTICE + "\n"


def test_a_refused_config_shows_no_notice(capsys):
    assert main(["--job.use_for_integration_test", "--training.steps", "0"]) == 2
    assert capsys.readouterr().err == "error: training.steps must be >= 1, got 0\n"


def test_the_trainer_says_each_notice_once_and_names_the_2024_dataset_it_lacks(tmp_path):
    # The late-2024 debug config through the real trainer, with a tokenizer this machine has: its
    # c4_test dataset (a file of torchtitan's repository) ends the run in one line, before a step.
    path = write_toml(tmp_path / "debug_model.toml", DEBUG_2024)
    result = run_train(["--job.config_file", path, "--model.tokenizer_path", "bundled:stdlib_docs/tokenizer.model",
                        "--job.dump_folder", str(tmp_path / "out")], check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: unknown training.dataset 'c4_test'; known: c4, reverse_words, stdlib_docs (or set "
                                          "training.dataset_path to local files)"]
    for notice in (INTEGRATION_NOTICE, INTERVAL_NOTICE):
        assert result.stdout.count(notice) == 1
