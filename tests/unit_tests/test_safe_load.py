"""Reading DCP checkpoints without running code from them."""

import os
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata

# DCP warns that these single-process saves and loads are single-process; they are meant to be.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this object runs a command (the classic pickle exploit)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Custom:
    def __init__(self):
        self.value = 3


def save(path, state):
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_metadata_reads_like_dcps_own_reader(tmp_path):
    state = {"model": {"w": torch.randn(3, 4, dtype=torch.bfloat16), "steps": torch.tensor(7)},
             "data": {"shard_0": {"docs_done": 3, "buffer": [1, 2, 3]}}}
    save(tmp_path, state)
    ours, theirs = read_metadata(tmp_path), FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.state_dict_metadata["model.w"].properties.dtype == torch.bfloat16


def test_metadata_that_would_run_code_is_refused(tmp_path):
    save(tmp_path, {"w": torch.zeros(2)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        read_metadata(tmp_path)


def test_a_module_the_metadata_names_is_not_imported_before_the_refusal(tmp_path):
    # Importing a module runs its code: a crafted .metadata must not get to import anything.
    import sys

    name = "xml.dom.minidom"
    sys.modules.pop(name, None)
    save(tmp_path, {"w": torch.zeros(2)})
    (tmp_path / ".metadata").write_bytes(b"\x80\x04c" + name.encode() + b"\nparseString\n.")
    with pytest.raises(pickle.UnpicklingError, match=f"refusing to load {name}.parseString"):
        read_metadata(tmp_path)
    assert name not in sys.modules


def test_metadata_of_another_type_is_refused(tmp_path):
    save(tmp_path, {"w": torch.zeros(2)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(OrderedDict(a=1)))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        read_metadata(tmp_path)


def test_plain_entries_load_and_objects_are_refused(tmp_path):
    save(tmp_path / "plain", {"w": torch.ones(2), "data": {"docs_done": 5, "buffer": [4, 5], "name": "x"}})
    target = {"w": torch.zeros(2), "data": {"docs_done": 0, "buffer": [], "name": ""}}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path / "plain")), planner=SafeLoadPlanner(),
             no_dist=True)
    assert target["data"] == {"docs_done": 5, "buffer": [4, 5], "name": "x"}
    assert torch.equal(target["w"], torch.ones(2))

    save(tmp_path / "object", {"thing": Custom()})
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"thing": None}, storage_reader=SafeFileSystemReader(str(tmp_path / "object")),
                 planner=SafeLoadPlanner(), no_dist=True)
    assert "Unsupported global" in str(raised.value.failures) and "Custom" in str(raised.value.failures)
