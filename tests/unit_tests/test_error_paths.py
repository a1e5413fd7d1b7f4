"""The error-path report (tests/error_paths.py): what it counts as an error path, how it names
them, and when it fails the suite."""

import ast
import io
import textwrap

from tests import error_paths
from tests.error_paths import ErrorPath, paths_in, summarize

SOURCE = textwrap.dedent('''
    import os, sys

    class Refused(ValueError):
        pass

    def check(x):
        if x < 0:
            raise Refused(f"x must be >= 0, got {x}")
        if x > 9:
            raise Refused("x must be <= 9")
        raise ValueError("a builtin: not one of the project's classes")

    def main(argv):
        try:
            check(int(argv[0]))
        except Refused as e:
            print(e)
            return 2
        except (OSError, KeyError):
            sys.exit(3)
        try:
            pass
        except Refused:
            os._exit(4)
        sys.exit(0)
        return 0
''')


def _paths():
    return paths_in(ast.parse(SOURCE), "pkg/mod.py", {"Refused"})


def test_the_paths_of_a_source_and_their_names():
    names = [p.name for p in _paths()]
    assert names == [
        'pkg/mod.py::check::raise Refused "x must be >= 0, got"',
        'pkg/mod.py::check::raise Refused "x must be <= 9"',
        "pkg/mod.py::main::except Refused",
        "pkg/mod.py::main::exit return 2",
        "pkg/mod.py::main::except (OSError, KeyError)",
        "pkg/mod.py::main::exit sys.exit(3)",
        "pkg/mod.py::main::except Refused #2",  # the same name twice in one function
        "pkg/mod.py::main::exit os._exit(4)",
    ]
    lines = SOURCE.splitlines()
    by_name = {p.name: p for p in _paths()}
    # An except branch counts as run when its first statement ran.
    assert lines[by_name["pkg/mod.py::main::except Refused"].line - 1].strip() == "print(e)"


def _summary(ran_lines, ledger, check=True):
    out = io.StringIO()
    code = summarize(_paths(), {"pkg/mod.py": set(ran_lines)}, ledger, check, out)
    return code, out.getvalue()


def test_a_path_that_did_not_run_fails_the_check_unless_the_ledger_says_why():
    paths = _paths()
    every_line = {p.line for p in paths}
    code, text = _summary(every_line, {})
    assert code == 0 and "all        8 of 8" in text

    untested = paths[1]
    code, text = _summary(every_line - {untested.line}, {})
    assert code == 1 and "no reason given (1)" in text and f"{untested.name}  (pkg/mod.py:{untested.line})" in text
    assert _summary(every_line - {untested.line}, {}, check=False)[0] == 0  # the report alone never fails

    code, text = _summary(every_line - {untested.line}, {untested.name: "needs a GPU"})
    assert code == 0 and "needs a GPU" in text and "all        7 of 8" in text


def test_a_ledger_entry_for_a_path_that_ran_or_is_gone_is_reported_stale():
    every_line = {p.line for p in _paths()}
    code, text = _summary(every_line, {_paths()[0].name: "old reason", "pkg/mod.py::gone::raise Refused": "old"})
    assert code == 0 and "no longer apply" in text and "pkg/mod.py::gone::raise Refused" in text


def test_the_product_has_error_paths_of_every_kind():
    # A scan that finds nothing would let the suite's check pass vacuously.
    kinds = {error_paths.kind(p) for p in error_paths.find_error_paths()}
    assert kinds == {"raise", "except", "exit"}
    assert len(error_paths.find_error_paths()) > 300
    assert isinstance(error_paths.find_error_paths()[0], ErrorPath)
