"""The torch compat seam (torchtitan/runtime/torch_compat): every private torch name it relies on
still exists in the installed torch, callables with the parameters the seam passes; and the
product outside the seam uses no private torch name (tests/private_torch_names.py finds them), so
a new one fails here with its file:line."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest

import torchtitan.runtime.torch_compat as torch_compat
from tests import private_torch_names
from tests.private_torch_names import Use, find_uses, in_seam, scan_file
from torchtitan.runtime.torch_compat import PrivateName

pytestmark = pytest.mark.fast

@functools.cache
def product_uses() -> tuple[Use, ...]:
    return tuple(find_uses())


def seam_modules() -> list:
    return [importlib.import_module(f"{torch_compat.__name__}.{info.name}")
            for info in pkgutil.iter_modules(torch_compat.__path__)]


def private_names() -> list[PrivateName]:
    return [name for module in seam_modules() for name in module.PRIVATE_NAMES]


def _parameters(obj) -> list[str] | None:
    """Parameter names of a callable (a class: of the first __init__ in its MRO that names them),
    None where Python cannot tell (C++ functions)."""
    if isinstance(obj, type):
        try:
            params = list(inspect.signature(obj).parameters.values())
        except (TypeError, ValueError):
            params = []
        if params and not all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            return [p.name for p in params]
        for klass in obj.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            try:
                params = list(inspect.signature(init).parameters.values())
            except (TypeError, ValueError):
                return None
            if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[1:]):
                continue  # (self, *args, **kwargs): passes them on to a base
            return [p.name for p in params[1:]]
        return None
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _sets_on_instances(owner: type, attr: str) -> bool:
    for klass in owner.__mro__:
        if klass.__module__.split(".")[0] != "torch":
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(attr)}\b", source):
            return True
    return False


def test_every_seam_module_lists_its_private_names():
    modules = seam_modules()
    assert modules, "the seam has no modules"
    for module in modules:
        assert module.PRIVATE_NAMES, f"{module.__name__} lists no PRIVATE_NAMES"
        assert all(isinstance(n, PrivateName) for n in module.PRIVATE_NAMES)


@pytest.mark.parametrize("name", private_names(), ids=lambda n: n.path)
def test_private_name_exists_with_its_parameters(name: PrivateName):
    if name.instance:
        owner_path, attr = name.path.rsplit(".", 1)
        owner = private_torch_names.resolve(owner_path)
        assert isinstance(owner, type), f"{owner_path} is gone from torch {torch_compat_version()}"
        # An optional name may be missing from a build: the seam checks for it first.
        assert _sets_on_instances(owner, attr) or name.optional, f"{owner_path} no longer sets self.{attr}"
        return
    obj = private_torch_names.resolve(name.path)
    if obj is private_torch_names.MISSING:
        # An optional name may be missing from a build (a CUDA-only one on CPU): the seam checks first.
        assert name.optional, f"{name.path} is gone from torch {torch_compat_version()} (checked: {name.checked})"
        return
    if name.params is not None:
        params = _parameters(obj)
        assert params is not None, f"{name.path} has no Python signature to check"
        assert params[: len(name.params)] == list(name.params), (
            f"{name.path}{inspect.signature(obj) if not isinstance(obj, type) else ''} no longer starts with "
            f"parameters {name.params} (checked: {name.checked})")


def test_fsdp_keeps_its_parameter_groups_under_one_of_the_names_the_seam_reads():
    """torch 2.13 keeps a list (`_fsdp_param_groups`), 2.11 one group (`_fsdp_param_group`): both
    are optional to the seam, so at least one must be there."""
    owner = private_torch_names.resolve("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState")
    assert any(_sets_on_instances(owner, attr) for attr in ("_fsdp_param_groups", "_fsdp_param_group"))


def torch_compat_version() -> str:
    import torch

    return torch.__version__


def test_every_private_name_the_seam_uses_is_listed():
    """What the counting tool finds in a seam module is covered by that module's PRIVATE_NAMES (each
    private part of a use is a part of some listed path), so the version check sees it."""
    uses = [u for u in product_uses() if in_seam(u)]
    by_module = {m.__file__.split("torchtitan/", 1)[1]: m for m in seam_modules()}
    missing = []
    for use in uses:
        module = by_module.get(use.path.split("torchtitan/", 1)[1])
        listed = {part for n in getattr(module, "PRIVATE_NAMES", ()) for part in n.path.split(".")}
        parts = re.findall(r"_?\w+", use.name.strip("'"))
        unlisted = [p for p in parts if private_torch_names._private(p) and p not in listed]
        if unlisted:
            missing.append(f"{use.path}:{use.line}: {use.name} ({', '.join(unlisted)} not in PRIVATE_NAMES)")
    assert not missing, "\n".join(missing)


def test_the_product_uses_no_private_torch_name_outside_the_seam():
    outside = [u for u in product_uses() if not in_seam(u)]
    assert not outside, (
        "private torch names outside torchtitan/runtime/torch_compat (wrap each there, with the versions it was "
        "checked against, or use a public API):\n" + "\n".join(f"{u.path}:{u.line}: {u.name}" for u in outside))


def test_the_counting_tool_finds_each_kind_and_skips_the_projects_own(tmp_path):
    source = textwrap.dedent('''
        import torch
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.pipelining import schedules
        from torch.distributed._tools.mem_tracker import MemTracker
        aten = torch.ops.aten

        def f(mesh, schedule, module, obj):
            torch._foreach_mul_([], 1.0)
            funcol.all_reduce(None, "sum", None)
            schedules._Action(0, None, 0)
            aten._scaled_mm(None, None)
            mesh._flatten("x")
            getattr(schedule, "_stages", None)
            obj._ep_dispatch = None
            module._my_own_thing()
            return "_grouped_mm", "not_private"

        class Mine:
            def __init__(self):
                self._stages = []

        class Tracker(MemTracker):
            def _pre_fw_hook(self, module, inputs):
                return self._mod_tracker
    ''')
    path = tmp_path / "example.py"
    path.write_text(source)
    found = {(u.name, u.kind) for u in scan_file(path, tmp_path)}
    assert found == {
        ("torch.distributed._functional_collectives", "import"),
        ("torch.distributed._tools.mem_tracker.MemTracker", "import"),
        ("torch._foreach_mul_", "chain"),
        ("torch.distributed._functional_collectives.all_reduce", "chain"),
        ("torch.distributed.pipelining.schedules._Action", "chain"),
        ("torch.ops.aten._scaled_mm", "chain"),
        ("._flatten", "attribute"),
        ("._stages", "attribute"),
        ("'_grouped_mm'", "string"),
        ("._pre_fw_hook", "attribute"),
        ("._mod_tracker", "attribute"),
    }
    assert Use("example.py", 9, "torch._foreach_mul_", "chain") in scan_file(path, tmp_path)
    ast.parse(source)  # the example itself is valid Python
