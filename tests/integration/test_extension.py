"""A model registered through the public TrainSpec API (the docs/extension.md example) trains."""

import re

import pytest

from tests.helpers import REPO_ROOT, TINY_RUN, losses, read_setup, run_train


@pytest.mark.fast
def test_registered_toy_model_trains_with_fsdp(tmp_path):
    doc = (REPO_ROOT / "docs" / "extension.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "toy_model.py").write_text(code)
    run_train([*TINY_RUN, "--job.dump_folder", str(tmp_path / "out"),
               "--experimental.custom_import", "toy_model", "--model.name", "toy_mlp",
               "--model.flavor", "tiny", "--activation_checkpoint.mode", "none",
               "--optimizer.lr", "3e-3"], nproc=2, extra_env={"PYTHONPATH": str(tmp_path)})
    setup = read_setup(tmp_path / "out")
    assert (setup["model"]["name"], setup["model"]["flavor"]) == ("toy_mlp", "tiny")
    assert setup["fsdp"]["mesh"] == {"dp_shard_cp": 2}
    values = losses(tmp_path / "out")
    assert len(values) == 10 and values[-1] < values[0]
