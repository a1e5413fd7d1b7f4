"""A Qwen3 mixture-of-experts checkpoint written under expert parallelism continues under another
layout with the losses of a run that never changed layout (within 1e-4): EP 2 (2 ranks) -> EP 4
(4 ranks) and -> one process, from the step-3 checkpoint of a 6-step run. Every run keeps the global
batch (8 rows); the reference reads the data in 4 shards (training.dataset_shards 4) so that the
4 data-parallel ranks of EP 4 can continue its data position (2 shards cannot be split over 4).

The checkpoint's names and shapes do not depend on the layout: its DCP metadata holds the stacked
experts under their model names with the global (experts, ...) shape, and the load-balancing
bias (a persistent buffer, changed every step by --moe.bias_update_rate) beside them."""

import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import TINY_RUN, read_metrics, read_setup, run_train
from torchtitan.config.manager import parse_args
from torchtitan.config.preflight import preflight

STEPS, SAVED = 6, 3
TOLERANCE = 1e-4
BATCH = 8  # global rows per step
MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.bias_update_rate", "0.001"]
LAYOUTS = {  # name: (processes, overrides)
    "ep2": (2, ["--training.data_parallel_shard_degree", "2", "--training.expert_parallel_degree", "2"]),
    "ep4": (4, ["--training.data_parallel_shard_degree", "4", "--training.expert_parallel_degree", "4"]),
    "single": (1, []),
}
EXPERTS, DIM, MOE_HIDDEN = 8, 128, 128  # tiny_moe (2 blocks)


def run(folder, layout, extra=()):
    nproc, overrides = LAYOUTS[layout]
    args = [*TINY_RUN, *MOE, "--training.steps", str(STEPS), "--training.deterministic", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", str(SAVED), "--training.batch_size", str(BATCH // nproc),
            "--job.dump_folder", str(folder), *overrides, *extra]
    return run_train(args, nproc=nproc, timeout=400)


def losses(folder):
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


def read_tensors(checkpoint, shapes):
    """Tensors of a DCP checkpoint by their flattened names, read in this process."""
    state = {name: torch.empty(shape) for name, shape in shapes.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """EP 2 on 2 ranks for all 6 steps, checkpoints at steps 3 and 6."""
    folder = tmp_path_factory.mktemp("moe") / "ep2"
    run(folder, "ep2", ["--training.dataset_shards", "4"])
    return folder


def test_checkpoint_names_and_shapes_are_global(reference):
    metadata = FileSystemReader(str(reference / "checkpoint" / f"step-{SAVED}")).read_metadata().state_dict_metadata
    global_shapes = {"w1": (EXPERTS, MOE_HIDDEN, DIM), "w2": (EXPERTS, DIM, MOE_HIDDEN), "w3": (EXPERTS, MOE_HIDDEN, DIM)}
    for w, shape in global_shapes.items():
        # Each EP 2 rank holds 4 of the 8 experts; the checkpoint holds all 8 under one name.
        assert tuple(metadata[f"model.layers.0.moe.experts.{w}"].size) == shape, w
        assert f"optimizer.state.layers.0.moe.experts.{w}.exp_avg" in metadata
    assert tuple(metadata["model.layers.0.moe.expert_bias"].size) == (EXPERTS,)
    # Exactly the names and shapes of the model built in one process (on the meta device).
    model = preflight(parse_args([*TINY_RUN, *MOE]), world_size=1).model
    one_process = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    saved = {k: tuple(v.size) for k, v in metadata.items() if k.startswith("model.")}
    assert saved == one_process
    bias = read_tensors(reference / "checkpoint" / f"step-{SAVED}", {"model.layers.0.moe.expert_bias": (EXPERTS,)})
    assert bias["model.layers.0.moe.expert_bias"].abs().sum() > 0, "the bias never moved: the test would not see it lost"


@pytest.mark.parametrize("layout", ["ep4", "single"])
def test_ep2_checkpoint_continues_under(layout, reference, tmp_path):
    folder = tmp_path / layout
    shutil.copytree(reference / "checkpoint" / f"step-{SAVED}", folder / "checkpoint" / f"step-{SAVED}")
    run(folder, layout)
    setup = read_setup(folder)
    assert setup["initial_load"]["step"] == SAVED and not setup["initial_load"]["weights_only"]
    assert setup["data_shards"] == 4
    if layout == "ep4":
        assert setup["mesh"] == {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 4}

    expected, got = losses(reference), losses(folder)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    diffs = [abs(got[s] - expected[s]) for s in got]
    print(f"{layout} from step {SAVED + 1}: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) <= TOLERANCE, list(zip(got.values(), (expected[s] for s in got)))

    # The bias and the experts went on as in the reference: the state was loaded, not re-initialised.
    shapes = {"model.layers.0.moe.expert_bias": (EXPERTS,), "model.layers.1.moe.experts.w2": (EXPERTS, DIM, MOE_HIDDEN)}
    ours = read_tensors(folder / "checkpoint" / f"step-{STEPS}", shapes)
    theirs = read_tensors(reference / "checkpoint" / f"step-{STEPS}", shapes)
    for name in shapes:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=name)
