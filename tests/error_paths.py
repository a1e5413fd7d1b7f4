"""Which error paths of the product the test suite has run, from the suite's coverage data.

An error path is code that runs only when something goes wrong, so it is the code a user meets
first and a test meets last. Three kinds are found in the source of torchtitan/ and scripts/:

- raise:  a `raise` of one of the project's error classes (RunEnded and its kin, any class
          defined in the product that derives from an exception) or of SystemExit;
- except: an `except` branch (its first statement): what reports, cleans up or recovers;
- exit:   a process ending with a code that is not 0: sys.exit / os._exit / exit_process /
          SystemExit with anything but 0, and `return <code>` from a `main`.

Each path has a name that survives edits elsewhere in its file:
`<file>::<function>::<kind> <what>`, e.g. `torchtitan/runtime/launch.py::main::except KeyboardInterrupt`
(`#2`, `#3` ... tell apart paths of the same name in one function).

    python -m tests.error_paths --data-file .coverage-data/suite [--check]

prints how many paths of each kind ran, and every one that did not, with the reason the ledger
(tests/error_paths_uncovered.txt) gives for it. With --check it fails (exit 1) when a path that
did not run has no reason there: a new error path gets a test, or a reason why none can reach it.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("torchtitan", "scripts")
LEDGER = ROOT / "tests" / "error_paths_uncovered.txt"
EXIT_CALLS = {"exit", "_exit", "exit_process"}  # sys.exit, os._exit, runtime/process_group.exit_process


@dataclass(frozen=True)
class ErrorPath:
    name: str
    file: str
    line: int  # the line coverage records when the path runs


def _sources() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py"))


def _error_class_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of the exception classes the product defines, found from the source alone."""
    known = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)}
    known |= {"CheckpointException", "RendezvousError", "ChildFailedError"}  # PyTorch's, which the product subclasses
    classes = {c.name: {_name(b) for b in c.bases} for t in trees.values() for c in ast.walk(t) if isinstance(c, ast.ClassDef)}
    project: set[str] = set()
    while True:
        new = {n for n, bases in classes.items() if n not in project and bases & (known | project)}
        if not new:
            return project
        project |= new


def _name(node: ast.AST | None) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _message_start(exc: ast.AST | None) -> str:
    """The message's first literal words, quoted (`` when it starts with a value): names a raise
    by what it says, which stays put when other raises are added to the function."""
    if not isinstance(exc, ast.Call) or not exc.args:
        return ""
    arg = exc.args[0]
    first = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return ""
    words = first.value.split()[:6]
    return f' "{" ".join(words)}"' if words else ""


def _is_nonzero_code(node: ast.AST | None) -> bool:
    """An exit code that is not a literal 0 (a variable may be 0, and counts: it is the failure's code)."""
    return not (isinstance(node, ast.Constant) and node.value in (0, None))


class _Finder(ast.NodeVisitor):
    def __init__(self, file: str, error_classes: set[str]):
        self.file, self.error_classes = file, error_classes
        self.scope: list[str] = []
        self.found: list[ErrorPath] = []

    def _add(self, what: str, line: int) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found.append(ErrorPath(f"{self.file}::{where}::{what}", self.file, line))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Raise(self, node: ast.Raise) -> None:
        name = _name(node.exc)
        if name == "SystemExit":
            if _is_nonzero_code(node.exc.args[0] if isinstance(node.exc, ast.Call) and node.exc.args else None):
                self._add("exit SystemExit", node.lineno)
        elif name in self.error_classes:
            self._add(f"raise {name}{_message_start(node.exc)}", node.lineno)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        caught = ast.unparse(node.type) if node.type is not None else "(anything)"
        self._add(f"except {caught}", node.body[0].lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _name(node.func) in EXIT_CALLS and isinstance(node.func, (ast.Attribute, ast.Name)):
            owner = _name(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            if (owner in ("sys", "os", "process_group", "") or _name(node.func) == "exit_process") and node.args:
                # sys.exit(main()) passes on a code decided elsewhere: main's returns are the paths.
                if _is_nonzero_code(node.args[0]) and not isinstance(node.args[0], ast.Call):
                    code = ast.unparse(node.args[0])
                    self._add(f"exit {ast.unparse(node.func)}({code if len(code) <= 40 else code[:37] + '...'})", node.lineno)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if self.scope and self.scope[-1] in ("main", "_main") and node.value is not None:
            value = node.value
            if isinstance(value, (ast.Constant, ast.Name, ast.Attribute)) and _is_nonzero_code(value) and not (
                    isinstance(value, ast.Constant) and not isinstance(value.value, int)):
                self._add(f"exit return {ast.unparse(value)}", node.lineno)
        self.generic_visit(node)


def paths_in(tree: ast.Module, file: str, error_classes: set[str]) -> list[ErrorPath]:
    finder = _Finder(file, error_classes)
    finder.visit(tree)
    seen: Counter[str] = Counter()
    paths = []
    for p in finder.found:
        seen[p.name] += 1
        paths.append(p if seen[p.name] == 1 else ErrorPath(f"{p.name} #{seen[p.name]}", p.file, p.line))
    return paths


def find_error_paths() -> list[ErrorPath]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _sources()}
    classes = _error_class_names(trees)
    return [e for path, tree in trees.items() for e in paths_in(tree, str(path.relative_to(ROOT)), classes)]


def executed_lines(data_file: str) -> dict[str, set[int]]:
    """Relative file -> the lines the suite ran, from a combined coverage data file."""
    from coverage import CoverageData

    data = CoverageData(basename=data_file)
    data.read()
    lines: dict[str, set[int]] = {}
    for measured in data.measured_files():
        path = Path(measured)
        if path.is_relative_to(ROOT):
            lines[str(path.relative_to(ROOT))] = set(data.lines(measured) or ())
    return lines


def read_ledger(path: Path = LEDGER) -> dict[str, str]:
    """Path name -> the reason no test reaches it. The file holds `[reason]` lines, each followed by
    the names of the paths it explains, one per line (`#` starts a comment line): plain text, since
    the names hold quotes of every kind."""
    ledger: dict[str, str] = {}
    reason = ""
    for number, raw in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            reason = line[1:-1].strip()
        elif not reason:
            raise ValueError(f"{path}:{number}: a path name before any [reason] line")
        else:
            ledger[line] = reason
    return ledger


def kind(p: ErrorPath) -> str:
    return p.name.split("::")[-1].split()[0]


def report(data_file: str, check: bool = False, out=sys.stdout, files: list[str] | None = None) -> int:
    paths = [p for p in find_error_paths() if not files or any(p.file.startswith(f) for f in files)]
    return summarize(paths, executed_lines(data_file), read_ledger(), check, out)


def summarize(paths: list[ErrorPath], lines: dict[str, set[int]], ledger: dict[str, str], check: bool = False,
              out=sys.stdout) -> int:
    ran = {p.name for p in paths if p.line in lines.get(p.file, ())}
    totals, covered = Counter(kind(p) for p in paths), Counter(kind(p) for p in paths if p.name in ran)
    print("error paths the suite ran (tests/error_paths.py):", file=out)
    for k in ("raise", "except", "exit"):
        print(f"  {k:<7}{covered[k]:>5} of {totals[k]:<5}", file=out)
    print(f"  all    {sum(covered.values()):>5} of {sum(totals.values())}", file=out)
    missing = [p for p in paths if p.name not in ran]
    unexplained = [p for p in missing if p.name not in ledger]
    by_reason: defaultdict[str, list[str]] = defaultdict(list)
    for p in missing:
        if p.name in ledger:
            by_reason[ledger[p.name]].append(p.name)
    if by_reason:
        print(f"not run, with the ledger's reason ({sum(map(len, by_reason.values()))}):", file=out)
        for reason, names in sorted(by_reason.items()):
            print(f"  {reason}", file=out)
            for name in names:
                print(f"    {name}", file=out)
    names = {p.name for p in paths}
    stale = sorted(n for n in ledger if n in ran or n not in names)
    if stale:
        print(f"ledger entries that no longer apply (the path ran, or is gone; remove them): {len(stale)}", file=out)
        for name in stale:
            print(f"  {name}", file=out)
    if unexplained:
        print(f"not run, and no reason given ({len(unexplained)}): test each, or give the reason in "
              f"{LEDGER.relative_to(ROOT)}", file=out)
        for p in unexplained:
            print(f"  {p.name}  ({p.file}:{p.line})", file=out)
    return 1 if check and unexplained else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-file", required=True, help="the combined coverage data of a whole-suite run")
    parser.add_argument("--check", action="store_true", help="exit 1 when a path that did not run has no reason in the ledger")
    parser.add_argument("--files", nargs="*", help="only the paths of these files (or folders): while testing a few")
    args = parser.parse_args(argv)
    return report(args.data_file, args.check, files=args.files)


if __name__ == "__main__":
    sys.exit(main())
