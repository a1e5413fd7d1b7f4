"""A mixture-of-experts checkpoint written under expert parallelism continues under another layout
with the losses of a run that never changed layout (within 1e-4), for Qwen3-MoE (EP 2 (2 ranks) ->
EP 4 (4 ranks) and -> one process) and DeepSeek-V3 (EP 2 -> EP 4, with its multi-token prediction
module, whose own loss must continue too), from the step-3 checkpoint of a 6-step run. Every run
keeps the global batch (8 rows); the reference reads the data in 4 shards (training.dataset_shards 4)
so that the 4 data-parallel ranks of EP 4 can continue its data position (2 shards cannot be split
over 4).

The checkpoint's names and shapes do not depend on the layout: its DCP metadata holds the stacked
experts under their model names with the global (experts, ...) shape, the MTP module under
`mtp.0.*`, and the load-balancing bias (a persistent buffer, changed every step by
--moe.bias_update_rate) beside them."""

import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import TINY_RUN, read_metrics, read_setup, run_train
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight
from torchtitan.tools.parity import LOSS_TOLERANCE as TOLERANCE  # fp32 sums in another order (its reasoning there)

STEPS, SAVED = 6, 3
BATCH = 8  # global rows per step
BIAS = ["--moe.bias_update_rate", "0.001"]
# model: (overrides, the MoE layers by name). Both tiny flavors: 8 experts of width 128 over dim 128.
MODELS = {
    "qwen3": (["--model.name", "qwen3", "--model.flavor", "tiny_moe", *BIAS], ("layers.0.moe", "layers.1.moe")),
    # A dense first block, an MoE one, and the MTP module's MoE block.
    "deepseek_v3": (["--model.name", "deepseek_v3", "--model.flavor", "tiny", *BIAS],
                    ("layers.1.moe", "mtp.0.block.moe")),
}
LAYOUTS = {  # name: (processes, overrides)
    "ep2": (2, ["--training.data_parallel_shard_degree", "2", "--training.expert_parallel_degree", "2"]),
    "ep4": (4, ["--training.data_parallel_shard_degree", "4", "--training.expert_parallel_degree", "4"]),
    "single": (1, []),
}
EXPERTS, DIM, MOE_HIDDEN = 8, 128, 128


def run(folder, model, layout, extra=()):
    nproc, overrides = LAYOUTS[layout]
    args = [*TINY_RUN, *MODELS[model][0], "--training.steps", str(STEPS), "--training.deterministic",
            "--checkpoint.enable_checkpoint", "--checkpoint.interval", str(SAVED), "--training.batch_size",
            str(BATCH // nproc), "--job.dump_folder", str(folder), *overrides, *extra]
    return run_train(args, nproc=nproc, timeout=400)


def logged(folder, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(folder) if key in r}


def read_tensors(checkpoint, shapes):
    """Tensors of a DCP checkpoint by their flattened names, read in this process."""
    state = {name: torch.empty(shape) for name, shape in shapes.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    return state


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each model's reference, made when first asked for: EP 2 on 2 ranks for all 6 steps,
    checkpoints at steps 3 and 6."""
    made = {}

    def reference(model):
        if model not in made:
            made[model] = tmp_path_factory.mktemp("moe") / f"{model}_ep2"
            run(made[model], model, "ep2", ["--training.dataset_shards", "4"])
        return made[model]
    return reference


@pytest.mark.parametrize("model", list(MODELS))
def test_checkpoint_names_and_shapes_are_global(model, references):
    folder = references(model)
    metadata = FileSystemReader(str(folder / "checkpoint" / f"step-{SAVED}")).read_metadata().state_dict_metadata
    global_shapes = {"w1": (EXPERTS, MOE_HIDDEN, DIM), "w2": (EXPERTS, DIM, MOE_HIDDEN), "w3": (EXPERTS, MOE_HIDDEN, DIM)}
    layers = MODELS[model][1]
    for layer in layers:
        for w, shape in global_shapes.items():
            # Each EP 2 rank holds 4 of the 8 experts; the checkpoint holds all 8 under one name.
            assert tuple(metadata[f"model.{layer}.experts.{w}"].size) == shape, (layer, w)
            assert f"optimizer.state.{layer}.experts.{w}.exp_avg" in metadata
        assert tuple(metadata[f"model.{layer}.expert_bias"].size) == (EXPERTS,)
    # Exactly the names and shapes of the model built in one process (on the meta device).
    built = preflight(parse_args([*TINY_RUN, *MODELS[model][0]]), world_size=1).model
    one_process = {f"model.{k}": tuple(v.shape) for k, v in built.state_dict().items()}
    saved = {k: tuple(v.size) for k, v in metadata.items() if k.startswith("model.")}
    assert saved == one_process
    if model == "deepseek_v3":  # the MTP module under its model names, written by both ranks' shards
        assert tuple(metadata["model.mtp.0.eh_proj.weight"].size) == (DIM, 2 * DIM)
    biases = read_tensors(folder / "checkpoint" / f"step-{SAVED}", {f"model.{n}.expert_bias": (EXPERTS,) for n in layers})
    for name, bias in biases.items():
        assert bias.abs().sum() > 0, f"{name} never moved: the test would not see it lost"


# DeepSeek-V3 proves the change of EP degree; -> one process is Qwen3's (the same loading path).
@pytest.mark.parametrize(("model", "layout"), [("qwen3", "ep4"), ("qwen3", "single"), ("deepseek_v3", "ep4")])
def test_ep2_checkpoint_continues_under(model, layout, references, tmp_path):
    reference = references(model)
    folder = tmp_path / layout
    shutil.copytree(reference / "checkpoint" / f"step-{SAVED}", folder / "checkpoint" / f"step-{SAVED}")
    run(folder, model, layout)
    setup = read_setup(folder)
    assert setup["initial_load"]["step"] == SAVED and not setup["initial_load"]["weights_only"]
    assert setup["data_shards"] == 4
    if layout == "ep4":
        assert setup["mesh"] == {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 4}
        assert setup["moe"]["ep_mesh"] == {"ep": 4} and setup["moe"]["experts_per_rank"] == 2

    keys = ["loss", "mtp_loss"] if model == "deepseek_v3" else ["loss"]
    for key in keys:  # the MTP module's own loss continues as well: its state was loaded, not made anew
        expected, got = logged(reference, key), logged(folder, key)
        assert sorted(got) == list(range(SAVED + 1, STEPS + 1)), key
        diffs = [abs(got[s] - expected[s]) for s in got]
        print(f"{model} {layout} from step {SAVED + 1}: max |{key} diff| {max(diffs):.2e}")
        assert max(diffs) <= TOLERANCE, (key, list(zip(got.values(), (expected[s] for s in got))))

    # The biases and the experts went on as in the reference: the state was loaded, not re-initialised.
    layers = MODELS[model][1]
    shapes = {**{f"model.{n}.expert_bias": (EXPERTS,) for n in layers},
              f"model.{layers[-1]}.experts.w2": (EXPERTS, DIM, MOE_HIDDEN)}
    ours = read_tensors(folder / "checkpoint" / f"step-{STEPS}", shapes)
    theirs = read_tensors(reference / "checkpoint" / f"step-{STEPS}", shapes)
    for name in shapes:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=name)
