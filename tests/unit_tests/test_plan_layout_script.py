"""scripts/plan_layout.py's refusals, in this process: each is one `error:` line on stderr and exit
status 2 (the planner itself, and its choices checked by the dry run, are test_planner.py and
integration/test_memory_estimate.py)."""


import pytest

from scripts import plan_layout
from scripts.plan_layout import main, why_none_fit
from torchtitan.estimation.dry_run import DryRunResult, RankEstimate
from torchtitan.estimation.planner import Choice, GiB, Layout, Model, NothingFits
from torchtitan.estimation.tracker import StepMemory

TINY = ["--flavor", "tiny", "--ngpu", "2", "--seq-len", "64"]



def _refused(capsys, argv: list[str]) -> tuple[str, str]:
    """Runs the planner; asserts exit 2 and that stderr ends in one `error:` line. Returns that
    line and stdout."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's mistakes end in the parser
        code = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in out + err
    return lines[0], out


@pytest.mark.parametrize("argv,expected", [
    (["--flavor", "nope", "--ngpu", "2"], "error: unknown flavor 'nope' of model 'llama3'; choose from debugmodel, "),
    (["--flavor", "tiny", "--ngpu", "two"], "error: argument --ngpu: expected a number, got 'two'"),
    (["--flavor", "tiny", "--ngpu", "2", "--device-memory", "80 GB"],
     "error: argument --device-memory: expected a number, got '80 GB'"),
    ([*TINY, "--config", "no/such.toml"], "error: --config file not found: no/such.toml"),
])
def test_command_line_mistakes(capsys, argv, expected):
    line, out = _refused(capsys, argv)
    assert line.startswith(expected), line
    assert out == ""


def test_a_global_batch_no_layout_takes(capsys):
    line, _ = _refused(capsys, ["--flavor", "tiny", "--ngpu", "3", "--global-batch", "1", "--seq-len", "64"])
    assert line == ("error: no layout of llama3 tiny on 3 devices (nodes of 8) takes a global batch of 1 sequences of 64: "
                    "the batch must divide by the data-parallel degree, with at least as many sequences per rank as "
                    "pipeline stages")


def test_a_device_too_small_for_every_layout(capsys):
    """Every layout's rough figure is over the device: no dry run is spent, and the line says so and
    what to change (not --max-dry-runs, which would change nothing)."""
    line, out = _refused(capsys, [*TINY, "--device-memory", "0.00001"])
    assert "  dry run " not in out and "0 under the device's memory by the rough figure" in out
    assert line.startswith("error: no layout of llama3 tiny on 2 devices fits 1e-05 GiB by the rough memory figure "
                           "(the smallest, ")
    assert line.endswith("GiB), so none was dry-run: raise --ngpu or --device-memory, or lower --seq-len or "
                         "--global-batch")


def _choice(ac: str, screened_gib: float, peak_gib: float | None = None) -> Choice:
    """A planned layout with its rough figure and, given a peak, a dry run's verdict."""
    layout = Layout(1, 2, 1, 1, 1, ac, 1, 1, 0)
    estimate = None
    if peak_gib is not None:
        memory = StepMemory(int(peak_gib * GiB), {}, {})
        estimate = DryRunResult(2, "cuda", "bfloat16", [], [RankEstimate(0, {}, (), memory, {}, 0.0)], GiB)
    return Choice(layout, None, int(screened_gib * GiB), estimate)


def test_a_budget_spent_on_layouts_that_do_not_fit_asks_for_more_dry_runs():
    """Only where layouts under the rough figure were left untried does the line name --max-dry-runs."""
    ns = plan_layout.parser().parse_args([*TINY, "--device-memory", "1", "--max-dry-runs", "1"])
    model = Model.from_flavor("llama3", "tiny")
    spent, every = NothingFits("none fits"), NothingFits("none fits")
    spent.choices, spent.dry_runs = [_choice("none", 0.9, 1.2), _choice("full", 0.5)], 1
    assert why_none_fit(ns, model, spent) == (
        "none of the 1 layouts dry-run fits, and 1 more pass the rough memory figure: raise --max-dry-runs to try "
        "them, or raise --ngpu or --device-memory, or lower --seq-len or --global-batch")
    every.choices, every.dry_runs = [_choice("none", 0.9, 1.2), _choice("full", 0.5, 1.1), _choice("selective", 3.0)], 2
    assert why_none_fit(ns, model, every) == (
        "none of the 2 layouts under the rough memory figure fits by the dry run (the smallest, dp_shard 2, AC full, "
        "batch 1, needs 1.1 GiB): raise --ngpu or --device-memory, or lower --seq-len or --global-batch")


def test_a_config_every_layout_refuses(capsys, tmp_path):
    """The trainer's own refusal of each layout is printed with it (the config's mistake, named),
    and is not counted as a dry run."""
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 4\nwarmup_steps = 9\n")
    line, out = _refused(capsys, [*TINY, "--config", str(config), "--max-dry-runs", "1"])
    refusals = [row for row in out.splitlines() if row.startswith("  refused: ")]
    assert len(refusals) > 1 and all("training.warmup_steps 9 is longer than the run" in row for row in refusals)
    assert line.startswith("error: the config checks refused every layout tried, the first with: "
                           "training.warmup_steps 9 is longer than the run")


def test_capacity_factors_need_a_build_with_the_dropping_mode(capsys, monkeypatch):
    monkeypatch.setattr(plan_layout, "capacity_option_available", lambda: False)
    line, _ = _refused(capsys, ["--model", "qwen3", "--flavor", "tiny_moe", "--ngpu", "2", "--capacity-factors", "1.25"])
    assert line == ("error: --capacity-factors needs a build with moe.capacity_factor (the dropping mode); this one "
                    "routes dropless only: leave the option out")


def test_an_moe_plan_pastes_expert_parallelism_and_shows_the_experts_memory(capsys):
    """One dry run of a tiny MoE on 4 devices: the pick names its ep, its settings paste it, and
    its memory is printed by category with the experts' share."""
    code = plan_layout.main(["--model", "qwen3", "--flavor", "tiny_moe", "--ngpu", "4", "--seq-len", "64", "--top", "1",
                             "--max-dry-runs", "1", "--device-memory", "80"])
    out = capsys.readouterr().out
    pick = out.split("\n1. ")[1].splitlines()
    assert code == 0 and ", ep " in pick[0]
    assert pick[1].strip().startswith("rank ") and "activations" in pick[1] and "of which experts" in pick[2]
    assert "--training.expert_parallel_degree" in pick[3]
