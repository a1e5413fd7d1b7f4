"""A converted checkpoint starts a training run from its weights, for every family with an HFAdapter:
a tiny random transformers model of the `tiny` flavor's shapes, converted with hf-to-dcp, gives a run
the losses of a run started from the Hugging Face folder itself (whose loading is proven against
transformers elsewhere), and a run of another flavor is refused in one line naming both models."""

import pytest

from tests.helpers import TINY_RUN, losses, read_setup, run_train
from tests.unit_tests.test_converted_checkpoints import convert, reference

FAMILY_RUNS = {"llama3": [], "qwen3": ["--model.name", "qwen3"], "gpt_oss": ["--model.name", "gpt_oss"]}
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


def test_a_model_with_more_embedding_rows_than_tokens_trains_with_its_own_tokenizer(tmp_path):
    """As Qwen3 publishes it (151,936 embedding rows for 151,669 tokens): a tiny Qwen3 Hugging Face
    folder of 2,256 rows holding a 1,024-token tokenizer.json (the bundled chat tokenizer). Started
    from the folder, or from its hf-to-dcp conversion, with model.tokenizer_path left alone, the run
    reads the folder's tokenizer (a notice says so), takes the folder's 2,256 rows as its vocabulary
    (the model transformers computes) so the weights load unchanged, and both starts train alike."""
    import shutil

    from tests.helpers import REPO_ROOT

    reference(tmp_path / "hf", "qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO_ROOT / "torchtitan" / "assets" / "chat_tokenizer" / name, tmp_path / "hf" / name)
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "dcp")
    runs = {}
    for start in ("hf", "dcp"):
        result = run_train([*TINY_RUN, *FAMILY_RUNS["qwen3"], *STEPS, "--checkpoint.initial_load_path",
                            str(tmp_path / start), "--job.dump_folder", str(tmp_path / f"run_{start}")])
        assert "the tokenizer is the one checkpoint.initial_load_path carries" in result.stdout + result.stderr
        setup = read_setup(tmp_path / f"run_{start}")
        assert setup["model"]["vocab_size"] == 2256, setup["model"]
        runs[start] = losses(tmp_path / f"run_{start}")
    assert runs["hf"] == runs["dcp"] and len(runs["hf"]) == 2
