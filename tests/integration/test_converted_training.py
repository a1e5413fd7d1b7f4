"""A converted checkpoint starts a training run from its weights, for every family with an HFAdapter:
a tiny random transformers model of the `tiny` flavor's shapes, converted with hf-to-dcp, gives a run
the losses of a run started from the Hugging Face folder itself (whose loading is proven against
transformers elsewhere), and a run of another flavor is refused in one line naming both models."""

import pytest

from tests.helpers import TINY_RUN, losses, read_setup, run_train
from tests.unit_tests.test_converted_checkpoints import convert, reference

FAMILY_RUNS = {"llama3": [], "qwen3": ["--model.name", "qwen3"]}
STEPS = ["--training.steps", "2", "--training.warmup_steps", "1"]


@pytest.mark.parametrize("family", list(FAMILY_RUNS))
def test_a_converted_folder_trains_like_the_hugging_face_folder_it_came_from(family, tmp_path):
    reference(tmp_path / "hf", family)
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "dcp")
    for start in ("dcp", "hf", ""):  # "": the run's own initial weights, which the others must not have
        load = ["--checkpoint.initial_load_path", str(tmp_path / start)] if start else []
        run_train([*TINY_RUN, *FAMILY_RUNS[family], *STEPS, *load, "--job.dump_folder", str(tmp_path / f"run_{start}")])
    assert read_setup(tmp_path / "run_dcp")["initial_load"]["path"] == str(tmp_path / "dcp")
    from_dcp, from_hf, fresh = (losses(tmp_path / f"run_{start}") for start in ("dcp", "hf", ""))
    print(f"{family} first losses: from the converted folder {from_dcp[0]:.6f}, from the HF folder {from_hf[0]:.6f}, "
          f"from fresh weights {fresh[0]:.6f}")
    assert len(from_dcp) == 2 and from_dcp == from_hf and abs(from_dcp[0] - fresh[0]) > 0.1, (from_dcp, from_hf, fresh)


def test_a_run_of_another_flavor_is_refused_naming_both(tmp_path):
    reference(tmp_path / "hf", "llama3")
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "dcp")
    result = run_train([*TINY_RUN, *STEPS, "--model.flavor", "debugmodel", "--checkpoint.initial_load_path",
                        str(tmp_path / "dcp"), "--job.dump_folder", str(tmp_path / "run")], check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint {tmp_path / 'dcp'} (written by llama3 tiny) does not fit llama3 "
                                "debugmodel: tok_embeddings.weight is [2256, 128] in the checkpoint, [2256, 256] in the "
                                "model (dim 128 vs 256, "), errors[0]
