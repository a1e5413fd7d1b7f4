"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP stores its `.metadata` file as a pickle and reads non-tensor entries with
`torch.load(weights_only=False)`. A checkpoint folder can come from anywhere (a colleague, a
download), and unpickling runs whatever code the file names. Here the metadata is read by an
unpickler that only builds DCP's own metadata classes and a few torch value types, and every
non-tensor entry goes through `torch.load(weights_only=True)`; tensor data is already read that
way by DCP's file-system reader.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan.runtime.torch_compat.checkpoint import set_element
from torchtitan.runtime.torch_compat.op_names import PICKLED_LAYOUT

# Modules whose classes make up DCP's metadata; nothing else in them is callable from a pickle.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    PICKLED_LAYOUT,
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Refused before the lookup: looking up imports the module, which runs its code.
        if module not in _DCP_MODULES and module != "torch" and (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's metadata")
        obj = super().find_class(module, name)
        if module in _DCP_MODULES and isinstance(obj, type) and not name.startswith("__"):
            return obj
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(obj, (torch.dtype, torch.layout))):
            return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's metadata")


def read_metadata(path: str | pathlib.Path) -> Metadata:
    """The DCP metadata of the checkpoint folder `path`, read safely."""
    with open(pathlib.Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path}/.metadata holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not used by this project
            raise ValueError("per-rank DCP metadata is not supported")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries read by `torch.load(weights_only=True)`
    (plain containers, numbers and strings load; arbitrary objects are refused)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
