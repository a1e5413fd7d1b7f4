"""Counts the private PyTorch names the product (torchtitan/ and scripts/) uses, and where.

    python -m tests.private_torch_names            # the count: names, places, files
    python -m tests.private_torch_names --where    # and every place, file:line

A private name is one whose last part, or a part on the way to it, starts with a single
underscore (`torch._C`, `schedules._Action`, `mesh._flatten`). Three kinds of use are found, by
reading each file's syntax tree (comments, docstrings and help texts do not count):

- imports of private torch modules or names (`from torch.distributed._tools import ...`,
  `from torch.distributed.checkpoint import _async_process_executor`);
- attribute chains on anything bound to torch by an import or a plain assignment
  (`torch._foreach_mul_`, `dist.distributed_c10d._set_pg_timeout`, `aten._scaled_mm` after
  `aten = torch.ops.aten`);
- private attributes of objects torch made (`mesh._flatten`, `schedule._stages`,
  `getattr(m, "_compiled_call_impl")`, a method a subclass of a torch class overrides or calls on
  `super()`), and private torch identifiers written as strings (op names, pickle allow-lists,
  flags set with `setattr`). The type of such an object is not known from the text, so its
  attribute counts when its name is one torch's own classes define (`torch_private_attributes`);
  the project's own privates (`self._meshes`, `module._ep_dispatch`) never do.

The guard test (tests/unit_tests/test_torch_compat.py) runs this over the product and fails on
any use outside the compat seam, torchtitan/runtime/torch_compat/.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import re
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PRODUCT_ROOTS = ("torchtitan", "scripts")
SEAM = Path("torchtitan/runtime/torch_compat")

# Torch classes whose objects the product holds; their private attributes (class-level and those
# their `__init__`s set on `self`) are what `obj._name` is checked against. Classes missing from
# the installed torch are skipped.
TORCH_CLASSES = (
    "torch.Tensor",
    "torch.nn.Module",
    "torch.optim.Optimizer",
    "torch.optim.lr_scheduler.LRScheduler",
    "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor._dispatch.OpDispatcher",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator",
    "torch.distributed.fsdp.FSDPModule",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup",
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam",
    "torch.distributed._composable.replicate._ReplicateState",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.distributed.pipelining.PipelineStage",
    "torch.distributed.pipelining.schedules.PipelineScheduleSingle",
    "torch.distributed.pipelining.schedules.PipelineScheduleMulti",
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
    "torch.distributed.pipelining.schedules.ScheduleInterleavedZeroBubble",
    "torch.distributed.pipelining.schedules.ScheduleZBVZeroBubble",
    "torch.distributed.pipelining.schedules.ScheduleDualPipeV",
    "torch.distributed.ProcessGroup",
    "torch.distributed.Store",
    "torch.distributed.checkpoint.FileSystemReader",
    "torch.distributed.checkpoint.FileSystemWriter",
    "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner",
    "torch.distributed.checkpoint._async_process_executor._AsyncCheckpointProcess",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
    "torch.distributed._tools.mem_tracker.MemTracker",
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch.utils.data.DataLoader",
    "torch.profiler.profile",
)

# Namespaces whose private members the product may name in a string (op names compared with a
# profile, ops looked up by name, a pickle allow-list).
TORCH_STRING_NAMESPACES = ("torch", "torch.ops.aten", "torch.serialization", "torch.distributed.pipelining.schedules")


@dataclasses.dataclass(frozen=True)
class Use:
    path: str  # relative to the repository root
    line: int
    name: str  # the torch name, dotted from `torch` where the text shows it, else `._attr` (or `'_op'`)
    kind: str  # import | chain | attribute | string


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


MISSING = object()  # what `resolve` returns for a name the installed torch lacks


def resolve(dotted: str):
    """The torch object named `dotted` (module path, then attributes), or MISSING."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except Exception:  # noqa: BLE001 - not a module (or not in this torch): try a shorter prefix
            continue
        try:
            for part in parts[end:]:
                obj = getattr(obj, part)
        except AttributeError:
            return MISSING
        return obj
    return MISSING


@functools.cache
def _attributes_set_on_self(source_file: str) -> frozenset[str]:
    """Private attributes a torch source file sets on `self` (whole files: parsing out one class
    with inspect.getsource costs seconds over torch's large modules)."""
    text = Path(source_file).read_text()
    return frozenset(m for m in re.findall(r"self\.(_\w+)\s*[:=]", text) if _private(m))


def _class_privates(cls: type) -> set[str]:
    """A torch class's private attributes: its own and inherited, and those its modules' code
    sets on instances."""
    names = {n for n in dir(cls) if _private(n)}
    for base in cls.__mro__:
        if base.__module__.split(".")[0] != "torch":
            continue
        try:
            source_file = inspect.getsourcefile(base)
        except TypeError:  # defined in C++
            continue
        if source_file:
            names |= _attributes_set_on_self(source_file)
    return names


@functools.cache
def torch_private_attributes() -> frozenset[str]:
    """Every private attribute name of the classes in TORCH_CLASSES (as installed)."""
    names: set[str] = set()
    for dotted in TORCH_CLASSES:
        cls = resolve(dotted)
        if isinstance(cls, type):
            names |= _class_privates(cls)
    return frozenset(names)


@functools.cache
def torch_private_strings() -> frozenset[str]:
    """Private names torch defines that the product may write as strings."""
    names = set(torch_private_attributes())
    for dotted in TORCH_STRING_NAMESPACES:
        obj = resolve(dotted)
        if obj is not MISSING:
            names.update(n for n in dir(obj) if _private(n))
    return frozenset(names)


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


class _FileScan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.uses: list[Use] = []
        self.aliases: dict[str, str] = {}  # local name -> dotted torch name
        self.private_aliases: set[str] = set()  # names bound by an import of a private torch name
        self.torch_bases: list[set[str]] = []  # private names of the torch base classes, per enclosing class

    def add(self, node: ast.AST, name: str, kind: str) -> None:
        self.uses.append(Use(self.path, node.lineno, name, kind))

    def torch_name(self, node: ast.AST) -> str | None:
        parts = _chain(node)
        if parts is None or parts[0] not in self.aliases:
            return None
        return ".".join([self.aliases[parts[0]], *parts[1:]])

    def names_private(self, node: ast.AST) -> bool:
        """Whether the chain as written names something private: a private part after its first
        name, or a first name an import of a private torch name bound (`funcol.all_reduce`)."""
        parts = _chain(node) or []
        return bool(parts) and (parts[0] in self.private_aliases or any(_private(p) for p in parts[1:]))

    # Imports bind torch names; private ones are uses.
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "torch":
                continue
            bound = alias.asname or "torch"
            self.aliases[bound] = alias.name if alias.asname else "torch"
            if any(_private(p) for p in alias.name.split(".")):
                self.add(node, alias.name, "import")
                if alias.asname:
                    self.private_aliases.add(bound)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] != "torch":
            return
        for alias in node.names:
            dotted = f"{module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = dotted
            if any(_private(p) for p in dotted.split(".")):
                self.add(node, dotted, "import")
                self.private_aliases.add(alias.asname or alias.name)

    def visit_Assign(self, node: ast.Assign) -> None:
        # `aten = torch.ops.aten`: the name now stands for a torch object too.
        value = self.torch_name(node.value)
        if value is not None:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.aliases[target.id] = value
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        privates: set[str] = set()
        for base in node.bases:
            dotted = self.torch_name(base)
            cls = resolve(dotted) if dotted else None
            if isinstance(cls, type) and cls.__module__.split(".")[0] == "torch" and cls.__name__ != "Module":
                privates |= _class_privates(cls)
        self.torch_bases.append(privates)
        for item in node.body:  # a private method of a torch base, overridden
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in privates:
                self.add(item, f".{item.name}", "attribute")
        self.generic_visit(node)
        self.torch_bases.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self.torch_name(node)
        if dotted is not None:
            # The longest chain only: `torch._C._distributed_c10d` is one use, not two.
            if self.names_private(node):
                self.add(node, dotted, "chain")
            return
        if _private(node.attr):
            inside = self.torch_bases[-1] if self.torch_bases else set()
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if _is_super_call(node.value) or own:
                if node.attr in inside:
                    self.add(node, f".{node.attr}", "attribute")
            elif node.attr in torch_private_attributes():
                self.add(node, f".{node.attr}", "attribute")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(obj, "_name") and friends are attribute accesses written as strings.
        func = node.func
        if (isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)):
            owner = self.torch_name(node.args[0])
            attr = node.args[1].value
            if owner is not None:
                self.add(node, f"{owner}.{attr}", "chain")
            else:
                if attr in torch_private_attributes():
                    self.add(node, f".{attr}", "attribute")
                self.visit(node.args[0])
            for arg in [*node.args[2:], *node.keywords]:
                self.visit(arg)
            return
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, str) and _private(value) and value.isidentifier() and value in torch_private_strings():
            self.add(node, f"'{value}'", "string")

    def visit_Expr(self, node: ast.Expr) -> None:
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):  # docstrings
            self.generic_visit(node)


def scan_file(path: Path, root: Path = REPO_ROOT) -> list[Use]:
    scan = _FileScan(path.relative_to(root).as_posix())
    scan.visit(ast.parse(path.read_text(), str(path)))
    return scan.uses


def product_files(root: Path = REPO_ROOT) -> list[Path]:
    return sorted(p for top in PRODUCT_ROOTS for p in (root / top).rglob("*.py"))


def find_uses(root: Path = REPO_ROOT) -> list[Use]:
    """Every private torch name the product uses, in file and line order."""
    return [use for path in product_files(root) for use in scan_file(path, root)]


def in_seam(use: Use) -> bool:
    return Path(use.path).is_relative_to(SEAM) or Path(use.path) == SEAM.with_suffix(".py")


def summary(uses: list[Use]) -> str:
    names = {u.name for u in uses}
    files = {u.path for u in uses}
    return f"{len(names)} names in {len(uses)} places in {len(files)} files"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--where", action="store_true", help="list every place, file:line")
    args = parser.parse_args()
    uses = find_uses()
    outside = [u for u in uses if not in_seam(u)]
    if args.where:
        for use in uses:
            print(f"{use.path}:{use.line}: {use.name} ({use.kind})")
        print()
        by_file: dict[str, int] = defaultdict(int)
        for use in uses:
            by_file[use.path] += 1
        for path, count in sorted(by_file.items(), key=lambda kv: -kv[1]):
            print(f"{count:4d}  {path}")
        print()
    print(f"product: {summary(uses)}")
    print(f"outside the seam ({SEAM}): {summary(outside)}")


if __name__ == "__main__":
    main()
