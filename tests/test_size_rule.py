"""The size rule, checked: nanoinfer/ in at most 6,500 code lines, the base engine (the reading
order of docs/ARCHITECTURE.md) in at most 2,400, no file over 300 lines, no function over 50
code lines outside kernels/, no line over 100 characters; and ARCHITECTURE.md's code-line figures
are the tree's (docs/costs.py computes them)."""
import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("costs", ROOT / "docs" / "costs.py")
costs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(costs)
FILES = sorted((ROOT / "nanoinfer").rglob("*.py"))


def test_the_package_and_the_base_engine_fit_their_budgets():
    assert sum(costs.file_cost(p) for p in FILES) <= 6500
    doc = costs.DOC.read_text(encoding="utf-8")
    base = set().union(*(files for _, files in costs.base_rows(doc)))
    assert len(base) > 20, "the reading-order table names the base engine's files"
    assert sum(costs.file_cost(p) for p in base) <= 2400


def test_architecture_figures_are_the_trees():
    doc = costs.DOC.read_text(encoding="utf-8")
    assert "<!-- costs -->" in doc
    assert costs.updated_doc(doc) == doc, "run python docs/costs.py --write"


def test_files_functions_and_lines_are_short():
    for path in FILES:
        src = path.read_text(encoding="utf-8")
        lines = src.splitlines()
        assert len(lines) <= 300, f"{path} has {len(lines)} lines"
        long = [i for i, line in enumerate(lines, 1) if len(line) > 100]
        assert not long, f"{path}: lines {long} are over 100 characters"
        if path.parent.name == "kernels":
            continue
        code = costs.code_lines(src)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len(code & set(range(node.lineno, node.end_lineno + 1)))
                assert n <= 50, f"{path}:{node.name} has {n} code lines"


def test_no_sequence_is_multiplied_by_a_bool():
    """`[x] * flag` to make a list empty: an `if` says it plainly."""
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                for seq, factor in ((node.left, node.right), (node.right, node.left)):
                    if isinstance(seq, (ast.Tuple, ast.List)):
                        flag = isinstance(factor, (ast.Compare, ast.BoolOp)) or (
                            isinstance(factor, ast.UnaryOp) and isinstance(factor.op, ast.Not)) \
                            or (isinstance(factor, ast.Call) and getattr(
                                factor.func, "id", None) == "bool")
                        assert not flag, f"{path}:{node.lineno}"


def test_costs_names_only_what_exists():
    for own, hooks in costs.MECHANISMS.values():
        costs.files_of(own)
        for hook in hooks:
            assert costs.hook_cost(hook) > 0, hook
    assert re.search(r"base engine: [\d,]+ code lines", costs.DOC.read_text(encoding="utf-8"))
