"""The product package's import graph: no circles among its modules, nothing from tests, and the
model code free of the dry run.

Every import statement counts, wherever it sits (module level, inside a function, under
`if TYPE_CHECKING:`), and importing `a.b.c` also counts as importing the packages `a` and `a.b`,
whose `__init__` runs first. A circle hidden in a function-level import is still a circle: it
only moves the failure to the first call.

Layering rules: no product module imports `tests` (test machinery lives there; the installed
package does not ship it), nor names a tests module in a string that something may import at run
time (`experimental.custom_import`, importlib); no module under torchtitan/models/ reaches the
estimation package, directly or through other modules: the dry run reaches the model only through
seams the estimation package fills (torchtitan/estimation/shapes_only.py); nothing under
torchtitan/config/ reaches the parallelisms package, directly or through other modules, except
config/preflight.py, which sits above the features (it builds ParallelDims, the pipeline plan and
the model) and which no other config module imports. The rules registry names feature checks as
"module:function" strings, imported only when a rule runs: the options need not know the features
that check them (docs/architecture.md, "Where each rule lives").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Mapping

import torchtitan

PACKAGE_ROOT = Path(torchtitan.__file__).parent


def product_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = ("torchtitan", *path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, module: str, modules: Mapping[str, Path] | None = None) -> set[str]:
    """Every dotted name an import statement in `path` refers to, relative imports resolved.
    `from pkg import x` names `pkg.x` when that is a module (one of `modules`), else `pkg`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    modules = product_modules() if modules is None else modules
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                names.add(submodule if submodule in modules else source)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        own_packages = {".".join(module.split(".")[:end]) for end in range(1, module.count(".") + 1)}
        edges = set()
        for name in imported_names(path, module, modules):
            parts = name.split(".")
            known = [".".join(parts[:end]) for end in range(1, len(parts) + 1) if ".".join(parts[:end]) in modules]
            if not known:
                continue
            # The module named (the longest known prefix) always counts, even when it is one of this
            # module's own packages (`from pkg import name` inside pkg reads pkg's half-run __init__).
            # The packages above it count too, except this module's own: they are already importing.
            edges.add(known[-1])
            edges.update(p for p in known[:-1] if p not in own_packages)
        edges.discard(module)  # `from torchtitan.config.manager import main` under __main__: the same file again
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def within(name: str, packages: tuple[str, ...]) -> bool:
    """`name` is one of `packages` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def forbidden_imports(imports: Mapping[str, set[str]], importers: tuple[str, ...],
                      forbidden: tuple[str, ...]) -> list[str]:
    """'module -> name' for every module within `importers` whose imports (`imports`: module ->
    the names its import statements refer to) include a name within `forbidden`."""
    return sorted(f"{module} -> {name}" for module, names in imports.items() if within(module, importers)
                  for name in names if within(name, forbidden))


def forbidden_reach(graph: Mapping[str, set[str]], importers: tuple[str, ...], forbidden: tuple[str, ...],
                    exempt: tuple[str, ...] = ()) -> list[str]:
    """For every module within `importers` (and not within `exempt`) that reaches a module within
    `forbidden` through the import `graph`, one chain of imports that gets there ('a -> b -> c'),
    shortest first found. A chain through an exempt module counts."""
    chains = []
    for start in sorted(m for m in graph if within(m, importers) and not within(m, exempt)):
        came_from: dict[str, str] = {start: ""}
        queue = [start]
        while queue:
            node = queue.pop(0)
            if node != start and within(node, forbidden):
                chain = [node]
                while came_from[chain[-1]]:
                    chain.append(came_from[chain[-1]])
                chains.append(" -> ".join(reversed(chain)))
                break
            for nxt in sorted(graph.get(node, ())):
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
    return chains


# A dotted name of a module under tests/ inside a string ("tests.machinery.matrix_model").
_TESTS_MODULE_IN_TEXT = re.compile(r"(?<![\w.])tests(?:\.[A-Za-z_]\w*)+")


def named_tests_modules(path: Path) -> set[str]:
    """The dotted tests modules `path`'s string literals name: what a custom import, importlib or
    a subprocess could import at run time without an import statement."""
    return {match for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            for match in _TESTS_MODULE_IN_TEXT.findall(node.value)}


MODELS = ("torchtitan.models",)
ESTIMATION = ("torchtitan.estimation", "torchtitan.shapes_only")  # shapes_only: the dry run's, wherever it lives
TESTS = ("tests",)
CONFIG = ("torchtitan.config",)
CONFIG_ABOVE_FEATURES = ("torchtitan.config.preflight",)
PARALLELISMS = ("torchtitan.parallelisms",)


def test_product_modules_import_no_circles():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    cycles = find_cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import circles:\n" + "\n".join(described)


def test_product_imports_nothing_from_tests():
    modules = product_modules()
    imports = {module: imported_names(path, module, modules) for module, path in modules.items()}
    offenders = forbidden_imports(imports, ("torchtitan",), TESTS)
    assert not offenders, f"product modules importing from tests/: {offenders}"
    named = {module: named_tests_modules(path) for module, path in modules.items()}
    offenders = forbidden_imports(named, ("torchtitan",), TESTS)
    assert not offenders, f"product modules naming a tests module for a run-time import: {offenders}"


def test_models_do_not_reach_estimation():
    graph = import_graph()
    assert any(within(m, MODELS) for m in graph) and any(within(m, ESTIMATION) for m in graph)
    chains = forbidden_reach(graph, MODELS, ESTIMATION)
    assert not chains, "model code importing the dry run's (give the model a seam instead):\n" + "\n".join(chains)


def test_config_does_not_reach_the_parallelisms():
    graph = import_graph()
    assert {"torchtitan.config.manager", "torchtitan.config.rules", *CONFIG_ABOVE_FEATURES} <= set(graph)
    chains = forbidden_reach(graph, CONFIG, PARALLELISMS, exempt=CONFIG_ABOVE_FEATURES)
    assert not chains, ("config/ importing a parallelism (a rule that needs ParallelDims or a pipeline plan lives "
                        "with its feature, named in config/rules.py as 'module:function'):\n" + "\n".join(chains))
    importers = forbidden_imports(graph, CONFIG, CONFIG_ABOVE_FEATURES)
    assert not importers, f"config modules importing preflight, which sits above the features: {importers}"


def test_the_layering_rules_can_fail(tmp_path):
    # The checkers themselves, on a synthetic package: an import of tests inside a function, a
    # tests module named in a string, and models reaching estimation directly or through a module
    # between are all found; what the rules allow is not.
    modules = {name: tmp_path for name in ("torchtitan.tools", "torchtitan.tools.parity", "torchtitan.models",
                                           "torchtitan.models.moe", "torchtitan.estimation",
                                           "torchtitan.estimation.shapes_only")}
    module = tmp_path / "parity.py"
    module.write_text("import os\n\ndef f():\n    from tests.machinery import layout_matrix\n"
                      "    return '--experimental.custom_import tests.machinery.matrix_model'\n"
                      "DOC = 'see tests/machinery/ and tests.'\n")
    imports = {"torchtitan.tools.parity": imported_names(module, "torchtitan.tools.parity", modules),
               "tests.helpers": {"tests.machinery.warm_launcher"}}  # tests may import tests
    assert forbidden_imports(imports, ("torchtitan",), TESTS) == ["torchtitan.tools.parity -> tests.machinery"]
    assert named_tests_modules(module) == {"tests.machinery.matrix_model"}
    direct = {"torchtitan.models.moe": {"torchtitan.estimation.shapes_only"}, "torchtitan.estimation.shapes_only": set()}
    assert forbidden_reach(direct, MODELS, ESTIMATION) == ["torchtitan.models.moe -> torchtitan.estimation.shapes_only"]
    through = {"torchtitan.models": {"torchtitan.models.moe"}, "torchtitan.models.moe": {"torchtitan.tools.parity"},
               "torchtitan.tools.parity": {"torchtitan.estimation"}, "torchtitan.estimation": set()}
    assert forbidden_reach(through, MODELS, ESTIMATION) == [
        "torchtitan.models -> torchtitan.models.moe -> torchtitan.tools.parity -> torchtitan.estimation",
        "torchtitan.models.moe -> torchtitan.tools.parity -> torchtitan.estimation"]
    allowed = {"torchtitan.estimation.shapes_only": {"torchtitan.models.moe"}, "torchtitan.models.moe": set()}
    assert forbidden_reach(allowed, MODELS, ESTIMATION) == []  # estimation may import the model
    # config/: preflight may import a parallelism; another config module may not, nor reach one through it.
    config = {"torchtitan.config.preflight": {"torchtitan.parallelisms.parallel_dims"},
              "torchtitan.config.rules": set(), "torchtitan.config.manager": {"torchtitan.config.rules"},
              "torchtitan.parallelisms.parallel_dims": {"torchtitan.config.job_config"}}
    assert forbidden_reach(config, CONFIG, PARALLELISMS, exempt=CONFIG_ABOVE_FEATURES) == []
    config["torchtitan.config.rules"] = {"torchtitan.config.preflight"}
    assert forbidden_reach(config, CONFIG, PARALLELISMS, exempt=CONFIG_ABOVE_FEATURES) == [
        "torchtitan.config.manager -> torchtitan.config.rules -> torchtitan.config.preflight -> "
        "torchtitan.parallelisms.parallel_dims",
        "torchtitan.config.rules -> torchtitan.config.preflight -> torchtitan.parallelisms.parallel_dims"]
    assert forbidden_imports(config, CONFIG, CONFIG_ABOVE_FEATURES) == ["torchtitan.config.rules -> torchtitan.config.preflight"]


def test_the_walk_sees_circles_and_hidden_imports(tmp_path):
    # The detector itself: a circle through a function-level import, and one through a package's
    # __init__, are both found; an acyclic chain is not.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    modules = {name: tmp_path for name in ("torchtitan.pkg", "torchtitan.pkg.sibling", "torchtitan.pkg.other",
                                           "torchtitan.train")}
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from torchtitan.train import main\n    from . import sibling, CONSTANT\n")
    # A function-level import counts; a submodule reading its own package's names (CONSTANT) is
    # an edge to the package, whose __init__ may be half-run when it does.
    assert imported_names(module, "torchtitan.pkg.m", modules) == {"torchtitan.train", "torchtitan.pkg.sibling",
                                                                   "torchtitan.pkg"}
    package = tmp_path / "__init__.py"
    package.write_text("from .other import thing\n")
    assert imported_names(package, "torchtitan.pkg", modules) == {"torchtitan.pkg.other"}
