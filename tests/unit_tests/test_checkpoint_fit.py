"""Whether a checkpoint fits the model, decided from DCP metadata before any tensor is read."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from torchtitan.checkpoint.fit import FitCheck, ModelRecord, excluded_by, tied_aliases
from torchtitan.checkpoint.folders import CheckpointError
from torchtitan.checkpoint.model_args import args_record
from torchtitan.checkpoint.safe_load import read_metadata
from torchtitan.checkpoint.states import flatten
from torchtitan.config.manager import ConfigError, parse_args
from torchtitan.models.llama import ModelArgs, Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, multiple_of=16)


def build(**changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(TINY, **changes))


def states(model: Transformer, optimizer: bool = True) -> dict:
    """What a full checkpoint holds of the model and an AdamW that has taken a step."""
    out = {"model": get_model_state_dict(model)}
    if optimizer:
        opt = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        opt.step()
        out["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return out


def record(model: Transformer, flavor: str = "tiny") -> ModelRecord:
    return ModelRecord("llama3", flavor, args_record(model.args), tied_aliases(model))


def expected(model: Transformer, optimizer: bool = True) -> dict:
    flat = {k: v for name, value in states(model, optimizer).items() for k, v in flatten(name, value).items()}
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def check(tmp_path, saved, ours, exclude=(), allow_partial=False, optimizer=True, reports=None):
    """Saves `saved`, checks it against `ours` as one rank (or as the given other ranks too)."""
    dcp.save(states(saved, optimizer), checkpoint_id=str(tmp_path), no_dist=True)
    names = ["model", "optimizer"] if optimizer else ["model"]
    fit = FitCheck("step-5", read_metadata(tmp_path), record(saved), record(ours), names,
                   list(exclude), allow_partial)
    mine = fit.report(expected(ours, optimizer), separate_copies=False)
    return fit.decide([fit.shareable(mine), *(reports or [])], mine)


def test_the_same_model_fits_and_a_tied_alias_loads_through_its_weight(tmp_path):
    assert check(tmp_path / "a", build(), build()).skip == set()
    plan = check(tmp_path / "b", build(tie_word_embeddings=True), build(tie_word_embeddings=True))
    assert plan.skip == {"model.output.weight"} and plan.warnings == []


def test_an_untied_checkpoint_does_not_fit_a_tied_model_unless_its_output_is_excluded(tmp_path):
    with pytest.raises(CheckpointError) as e:
        check(tmp_path / "a", build(), build(tie_word_embeddings=True))
    assert str(e.value).startswith("checkpoint step-5 (written by llama3 tiny) does not fit llama3 tiny: output.weight "
                                   "is its own weight in the checkpoint, but this model ties it to tok_embeddings.weight "
                                   "(checkpoint is untied, model is tied)")
    assert "checkpoint.exclude_from_loading output.weight" in str(e.value) and "\n" not in str(e.value)
    plan = check(tmp_path / "b", build(), build(tie_word_embeddings=True), exclude=["output"])
    assert plan.skip == {"model.output.weight"}
    assert any("not loading output from step-5" in w for w in plan.warnings)


def test_a_tied_checkpoint_does_not_fit_an_untied_model(tmp_path):
    with pytest.raises(CheckpointError, match=r"\(checkpoint is tied, model is untied\) \(\+1 more difference\); use a tied model.flavor, or "
                                              r"set checkpoint.allow_partial_load to start output.weight as a copy"):
        check(tmp_path, build(tie_word_embeddings=True), build())
    # Deliberately: the output projection starts as a copy of the embedding, with fresh optimizer state.
    plan = check(tmp_path / "b", build(tie_word_embeddings=True), build(), allow_partial=True)
    assert "optimizer.state.output.weight.exp_avg" in plan.skip
    assert all(k.startswith("optimizer.") and ".output.weight." in k for k in plan.skip)
    assert plan.warnings[0].startswith("checkpoint.allow_partial_load: output.weight is tok_embeddings.weight")


def test_another_vocabulary_names_the_entry_and_both_shapes(tmp_path):
    with pytest.raises(CheckpointError) as e:
        check(tmp_path, build(), build(vocab_size=40), optimizer=False)
    assert ("does not fit llama3 tiny: tok_embeddings.weight is [32, 16] in the checkpoint, [40, 16] in the model "
            "(vocab_size 32 vs 40); 1 more entries differ in shape; check model.flavor and the tokenizer") in str(e.value)


def test_entries_on_one_side_only(tmp_path):
    with pytest.raises(CheckpointError, match="the checkpoint holds layers.1.attention.wk.weight, layers.1.attention.wo"
                                              r".weight, layers.1.attention.wq.weight and \d+ more, which this model "
                                              "does not have"):
        check(tmp_path / "a", build(), build(n_layers=1))
    with pytest.raises(CheckpointError, match="the checkpoint has no layers.1.attention.wk.weight"):
        check(tmp_path / "b", build(n_layers=1), build())
    plan = check(tmp_path / "c", build(n_layers=1), build(), allow_partial=True)
    assert "model.layers.1.attention.wq.weight" in plan.skip and "model.layers.0.attention.wq.weight" not in plan.skip


def test_ranks_decide_together_from_every_ranks_report(tmp_path):
    """Like pipeline stages: each rank expects part of the keys. Together they claim the whole
    checkpoint; a key that only rank 1 misses stops every rank."""
    model = build()
    dcp.save(states(model), checkpoint_id=str(tmp_path), no_dist=True)
    fit = FitCheck("step-5", read_metadata(tmp_path), record(model), record(model), ["model", "optimizer"], [], False)
    keys = sorted(expected(model))
    halves = [{k: s for k, s in expected(model).items() if k in part} for part in (keys[::2], keys[1::2])]
    reports = [fit.report(h, separate_copies=False) for h in halves]
    shared = [fit.shareable(r) for r in reports]
    assert fit.decide(shared, reports[0]).skip == set()  # neither half alone claims every entry
    with pytest.raises(CheckpointError, match="the checkpoint holds"):
        fit.decide(shared[:1], reports[0])
    halves[1]["model.extra.weight"] = (3,)
    shared[1] = fit.shareable(fit.report(halves[1], separate_copies=False))
    with pytest.raises(CheckpointError, match="the checkpoint has no extra.weight"):
        fit.decide(shared, reports[0])


def test_a_pipelined_tied_model_never_loads_one_copy_only(tmp_path):
    saved, ours = build(), build(tie_word_embeddings=True)
    dcp.save(states(saved), checkpoint_id=str(tmp_path), no_dist=True)
    fit = FitCheck("step-5", read_metadata(tmp_path), record(saved), record(ours), ["model", "optimizer"], ["output"], True)
    mine = fit.report(expected(saved), separate_copies=True)  # the last stage keeps its own copy
    with pytest.raises(CheckpointError, match="under pipeline parallelism a tied model loads only complete"):
        fit.decide([fit.shareable(mine)], mine)


def test_an_exclusion_that_names_nothing_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.exclude_from_loading 'outptu' names nothing in step-5"):
        check(tmp_path, build(), build(), exclude=["outptu"])


def test_exclusions_name_keys_and_parameters_at_dots():
    assert excluded_by(["output"], "model.output.weight") == "output"
    assert excluded_by(["output"], "optimizer.state.output.weight.exp_avg") == "output"
    assert excluded_by(["output"], "model.outputs.weight") is None
    assert excluded_by(["layers.1"], "model.layers.10.attention.wq.weight") is None
    assert excluded_by(["optimizer"], "optimizer.param_groups.norm.weight.lr") == "optimizer"
    assert excluded_by(["norm.weight"], "norm.weight", top_level=True) == "norm.weight"


def test_the_partial_load_options_need_a_checkpoint_to_load():
    with pytest.raises(ConfigError, match="checkpoint.exclude_from_loading applies to a checkpoint being loaded"):
        parse_args(["--checkpoint.exclude_from_loading", "output"])
    with pytest.raises(ConfigError, match="checkpoint.allow_partial_load applies to a checkpoint being loaded"):
        parse_args(["--checkpoint.allow_partial_load"])
    c = parse_args(["--checkpoint.enable_checkpoint", "--checkpoint.exclude_from_loading", "output, optimizer"]).checkpoint
    assert c.exclude_from_loading == ["output", "optimizer"] and not c.allow_partial_load
