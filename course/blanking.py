"""Blanking: take a function's body out of the engine's source, keeping its signature and docstring.

`start N` uses this on each function the assignment lists. The engine needs no markers for it:
a function is named by its path and qualified name (`nanoinfer/core/block_manager.py:
BlockManager.free`), found in the file's syntax tree, and every line of its body after the
docstring is replaced by one `raise NotImplementedError(...)`. The file still imports, so the
rest of the engine (and every other assignment) keeps working; only calls to the blanked
functions fail, with a message that names the assignment.
"""
import ast


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    """The definition of `qualname` ("function", "Class.method") at the top of a module."""
    body, node = tree.body, None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in qualname.split("."):
        found = [n for n in body if isinstance(n, kinds) and n.name == part]
        if len(found) != 1:
            raise LookupError(f"{qualname}: {len(found)} definitions of {part!r} in this file")
        node, body = found[0], found[0].body
    if isinstance(node, ast.ClassDef):
        raise LookupError(f"{qualname} is not a function")
    if node.body[0].lineno == node.lineno:
        raise LookupError(f"{qualname}: its body starts on the line of its `def`")
    return node


def body_lines(function: ast.FunctionDef) -> tuple[int, int, int]:
    """The 1-based first and last line of the body after its docstring, and its indent."""
    statements = function.body
    has_docstring = isinstance(statements[0], ast.Expr) and \
        isinstance(statements[0].value, ast.Constant) and isinstance(statements[0].value.value, str)
    if has_docstring:
        # (comments between the docstring and the code go with the code)
        first, indent = statements[0].end_lineno + 1, statements[0].col_offset
    else:
        first, indent = statements[0].lineno, statements[0].col_offset
    return first, function.end_lineno, indent


def blank_functions(source: str, qualnames: list[str], message: str) -> str:
    """`source` with the body of each function in `qualnames` replaced by a raise."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    spans = sorted((body_lines(find_function(tree, name)) + (name,) for name in qualnames),
                   reverse=True)
    # Last function first, so the line numbers of the others stay right.
    for first, last, indent, name in spans:
        error = f'{" " * indent}raise NotImplementedError("{message}: write {name}")\n'
        lines[first - 1:last] = [error]
    return "".join(lines)
