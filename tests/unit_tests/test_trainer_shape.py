"""The trainer stays readable: no function in torchtitan/train.py or torchtitan/trainer/ is longer
than 50 lines or takes more than 8 parameters (`self` and `cls` not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import torchtitan

PACKAGE_ROOT = Path(torchtitan.__file__).parent
MAX_LINES, MAX_PARAMETERS = 50, 8


def trainer_files() -> list[Path]:
    return [PACKAGE_ROOT / "train.py", *sorted((PACKAGE_ROOT / "trainer").rglob("*.py"))]


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def oversized(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1  # from `def` (decorators left out) to its last line
            count = len(parameters(node))
            if lines > MAX_LINES or count > MAX_PARAMETERS:
                found.append(f"{path.name}:{node.lineno} {node.name}: {lines} lines, {count} parameters")
    return found


def test_no_trainer_function_is_too_long_or_takes_too_many_parameters():
    files = trainer_files()
    assert len(files) >= 4  # train.py and the trainer package were found
    found = [line for path in files for line in oversized(path)]
    assert not found, f"over {MAX_LINES} lines or {MAX_PARAMETERS} parameters:\n" + "\n".join(found)


def test_the_check_sees_long_functions_and_many_parameters(tmp_path):
    module = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    module.write_text(f"def long():\n{body}\n\n\nclass C:\n    def wide(self, a, b, c, d, e, f, g, h, *, i=0):\n"
                      "        pass\n\n    def fits(self, a, b, c, d, e, f, g, h):\n        pass\n")
    assert [line.split(": ")[0].split()[1] for line in oversized(module)] == ["long", "wide"]
