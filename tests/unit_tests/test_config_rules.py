"""The rules registry (torchtitan/config/rules.py): each rule declared once, with a phase and the
options it reads; each runs once per process, in the phase its entry point runs; the launcher's
pre-check runs its phases without torch. Old options: test_unused_options.py."""

from __future__ import annotations

import dataclasses
import fnmatch
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import TINY_RUN
from torchtitan.config import rules
from torchtitan.config.manager import JobConfig, main, parse_args
from torchtitan.config.preflight import preflight
from torchtitan.parallelisms.parallel_dims import parallel_dims_from_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def all_options() -> list[str]:
    config = JobConfig()
    return [f"{s.name}.{o.name}" for s in dataclasses.fields(config) for o in dataclasses.fields(getattr(config, s.name))]


def test_each_rule_is_declared_once_with_a_phase_and_a_function():
    names = Counter(r.name for r in rules.RULES)
    assert [n for n, count in names.items() if count > 1] == []
    checks = Counter(r.check for r in rules.RULES)
    assert [c for c, count in checks.items() if count > 1] == [], "one function registered as two rules"
    for r in rules.RULES:
        assert r.phase in rules.PHASES, r
        module, _, function = r.check.partition(":")
        assert callable(getattr(__import__(module, fromlist=[function]), function)), r


def test_each_rule_names_options_that_exist():
    options = all_options()
    for r in rules.RULES:
        assert r.reads, r.name
        for pattern in r.reads:
            assert pattern == "*" or fnmatch.filter(options, pattern), f"rule {r.name} reads no option {pattern}"


class _Recorder:
    """A config (or one of its sections) that records which options a rule reads."""

    def __init__(self, target, read: set[str], prefix: str = ""):
        self._target, self._read, self._prefix = target, read, prefix

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not self._prefix:
            return _Recorder(value, self._read, name)
        self._read.add(f"{self._prefix}.{name}")
        return value


@pytest.mark.parametrize("argv", [[], [*TINY_RUN, "--experimental.pipeline_parallel_degree", "2", "--validation.enabled",
                                       "--training.data_parallel_replicate_degree", "2", "--optimizer.zero1"]])
def test_the_torch_free_rules_read_only_what_they_declare(argv):
    config = parse_args(argv)
    dims = parallel_dims_from_config(config, 4)
    for r in rules.RULES:
        if r.phase not in ("options", "shapes", "layout") or r.reads == ("*",):
            continue
        read: set[str] = set()
        recorder = _Recorder(config, read)
        if r.name == "world_size":
            r(recorder, 4)
        elif r.phase == "layout":
            r(recorder, dims)
        else:
            r(recorder)
        undeclared = {o for o in read if not any(fnmatch.fnmatch(o, p) for p in r.reads)}
        assert not undeclared, f"rule {r.name} reads {sorted(undeclared)} without declaring them"


def test_the_model_and_device_rules_read_only_what_they_declare(tmp_path):
    """Each with the arguments preflight gives it, on a job that reaches every rule's checks."""
    config = parse_args([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--training.document_mask",
                         "--validation.enabled", "--checkpoint.enable_checkpoint", "--metrics.enable_tensorboard",
                         "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                         "--optimizer.name", "Muon"])
    built = preflight(config, world_size=1, device_type="cpu")
    spec, dims = built.train_spec, built.parallel_dims
    n_params = sum(p.numel() for p in built.model.parameters())
    arguments = {
        "output_locations": lambda c: (c,), "export_target": lambda c: (c,), "flavor": lambda c: (spec, "tiny"),
        "document_mask": lambda c: (c, built.tokenizer, spec.model_cls), "pipelining_fn": lambda c: (spec, dims),
        "hf_export": lambda c: (c, spec), "validation_loader": lambda c: (c, spec),
        "experts": lambda c: (c, spec, dims, built.model), "muon_exclude": lambda c: (c, built.model),
        "lora_targets": lambda c: (c, built.model), "mtp": lambda c: (c, spec), "async_tp_device": lambda c: (c, "cpu"),
        "float8_device": lambda c: (c, "cpu", False), "memory_snapshot_device": lambda c: (c, "cpu"),
        "memory_floor": lambda c: (c, dims, built.model_args, "cpu", n_params),
    }
    checked = {r.name for r in rules.RULES if r.phase in ("model", "device") and r.reads != ("*",)}
    assert checked == set(arguments)
    for name, args in arguments.items():
        read: set[str] = set()
        rules.run(name, *args(_Recorder(config, read)))
        declared = next(r.reads for r in rules.RULES if r.name == name)
        undeclared = {o for o in read if not any(fnmatch.fnmatch(o, p) for p in declared)}
        assert not undeclared, f"rule {name} reads {sorted(undeclared)} without declaring them"


@pytest.fixture
def counted(monkeypatch):
    """Counts each rule's runs, by name."""
    runs: Counter[str] = Counter()
    call = rules.Rule.__call__

    def counting(rule, *args):
        runs[rule.name] += 1
        return call(rule, *args)

    monkeypatch.setattr(rules.Rule, "__call__", counting)
    return runs


def by_phase(*phases: str) -> set[str]:
    return {r.name for r in rules.RULES if r.phase in phases}


def test_a_rank_runs_each_rule_once(counted, tmp_path):
    """parse_args runs the options phase, preflight every other one: together each rule, once."""
    config = parse_args([*TINY_RUN, "--job.dump_folder", str(tmp_path)])
    assert set(counted) == by_phase("options") and set(counted.values()) == {1}
    counted.clear()
    preflight(config, world_size=1, device_type="cpu")
    assert set(counted) == by_phase("shapes", "layout", "model", "device")
    assert set(counted.values()) == {1}, {name: n for name, n in counted.items() if n != 1}


def test_the_launcher_pre_check_runs_the_torch_free_phases_once(counted, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*TINY_RUN, "--experimental.pipeline_parallel_degree", "2"]) == 0
    assert set(counted) == by_phase("options", "shapes", "layout") and set(counted.values()) == {1}


def test_the_launcher_pre_check_imports_no_torch():
    """Every phase it runs (options, shapes, layout) stays torch-free, pipeline plan included."""
    code = ("import os, sys; os.environ['WORLD_SIZE'] = '2'; from torchtitan.config.manager import main; "
            "rc = main(['--experimental.pipeline_parallel_degree', '2', '--training.tensor_parallel_degree', '1']); "
            "sys.exit(3 if 'torch' in sys.modules else rc)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
