"""Every error class of the project is built the way its constructor says, and survives pickling.

An error path runs rarely, so a wrong constructor call there is found by the user who hits it
(a full disk on 2 ranks once printed `TypeError: NotEnoughSpace.__init__() missing 1 required
positional argument` instead of its one line). Two checks close that off for every class at once:
each call of an error class anywhere in the product is bound against the class's signature
(statically, from the source), and each class is built and pickled the way DCP and background
saves move exceptions between processes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("torchtitan", "scripts")


def _sources() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _error_classes() -> dict[str, type[BaseException]]:
    """Name -> class, for every exception class defined in the product's source."""
    found: dict[str, type[BaseException]] = {}
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
        if not names:
            continue
        module = importlib.import_module(_module_name(path))
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                assert name not in found, f"two error classes named {name}: the static check below needs unique names"
                found[name] = cls
    return found


CLASSES = _error_classes()


def test_the_classes_are_found():
    # A discovery that silently finds nothing would make both checks below pass vacuously.
    for name in ("UserError", "ConfigError", "CheckpointSaveError", "NotEnoughSpace", "Stopped", "Preempted",
                 "DoesNotFit", "TokenizerError", "GenerateError"):
        assert name in CLASSES


def _signature(cls: type[BaseException]) -> inspect.Signature:
    """The constructor's signature; an exception class with no __init__ of its own in Python takes
    any positional arguments and no keywords, like the built-in exceptions it derives from."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if inspect.isfunction(init):
            return inspect.signature(cls)
    return inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


def _calls():
    """(file:line, class name, call node) for every call of a project error class in the product."""
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in CLASSES:
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", name, node
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name) and node.exc.id in CLASSES:
                # `raise SomeError` builds it with no arguments
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.exc.id, ast.Call(node.exc, [], [])


def test_every_constructor_call_matches_its_signature():
    wrong, checked = [], 0
    for where, name, call in _calls():
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue  # *args / **kwargs: not decidable from the source
        try:
            _signature(CLASSES[name]).bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as e:
            wrong.append(f"{where}: {name}(...): {e}")
        checked += 1
    assert not wrong, "error classes called with the wrong arguments:\n" + "\n".join(wrong)
    assert checked > 100, f"only {checked} calls of error classes found: the scan is broken"


def _example_args(cls: type[BaseException]) -> list:
    """Arguments a real raise would pass, chosen by parameter name (a message string otherwise)."""
    values = {"signum": 15, "step": 7, "needed": 3 * 2**20, "free": 2**20, "path": "/ckpt/step-7"}
    args = []
    for p in _signature(cls).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.kind == p.VAR_POSITIONAL and not args:
                args.append("what went wrong, naming the option")
            continue
        if p.default is not p.empty:
            continue
        args.append(values.get(p.name, "what went wrong, naming the option"))
    return args


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_each_error_class_is_built_and_pickled(name):
    cls = CLASSES[name]
    error = cls(*_example_args(cls))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
    if hasattr(error, "line"):  # a RunEnded: its one line and exit code survive the trip
        assert copy.line == error.line and copy.exit_code == error.exit_code
