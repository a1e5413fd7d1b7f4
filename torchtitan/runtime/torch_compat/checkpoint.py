"""DCP internals: writing into a nested state dict by path, ending the async-save process, and the
one private torch function DCP's metadata pickles name."""

from __future__ import annotations

from torch.distributed.checkpoint._traverse import set_element as _set_element

from torchtitan.runtime.torch_compat import CPU_AND_PRESENT_IN_2_11, PrivateName

PRIVATE_NAMES = (
    PrivateName("torch.distributed.checkpoint._traverse.set_element", ("root_dict", "path", "value"),
                checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.checkpoint._async_process_executor._CHECKPOINT_PROCESS", checked=CPU_AND_PRESENT_IN_2_11),
    PrivateName("torch.distributed.checkpoint._async_process_executor._AsyncCheckpointProcess.__del__", ("self",)),
    PrivateName("torch.serialization._get_layout", ("name",)),
)

# `set_element(state_dict, path, value)`: puts `value` at `path` (keys and list indices) of a nested
# state dict, as DCP's own load planner does for the entries it flattened; DCP has no public one.
set_element = _set_element


def end_async_checkpoint_process() -> None:
    """Ends DCP's async-save process, a daemon of this process kept in a private module global. A
    rank leaving through os._exit skips multiprocessing's clean-up, and DCP has no public close;
    the process's own finaliser (`__del__`) shuts it down."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        process.__del__()
