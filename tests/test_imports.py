"""The imports run one way. docs/ARCHITECTURE.md lists the rooms of nanoinfer/ from the top down
(between its `<!-- rooms -->` markers); every import of every file, at the top or inside a
function, goes to its own room or to a room further down, never up and never sideways to
another room of the same line; no modules import each other in a circle; nothing in nanoinfer/
imports the tools beside it. And the package imports, and runs on the CPU, without Triton
(pyproject installs it on Linux only)."""
import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoinfer"


def rooms() -> dict[str, int]:
    """Each room (a folder or a file directly under nanoinfer/) -> its line in the list."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    listing = doc[doc.index("<!-- rooms -->"):doc.index("<!-- /rooms -->")]
    levels = {}
    for level, line in enumerate(re.findall(r"^\d+\. (.*)$", listing, re.M)):
        for name in re.findall(r"`([^`]+)`", line):
            assert name not in levels, f"{name} is listed twice"
            levels[name.rstrip("/").removesuffix(".py")] = level
    return levels


def modules() -> dict[str, Path]:
    """Every module of nanoinfer/ by its dotted name (a package by its own)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict) -> list[tuple[int, str]]:
    """(line, module) of every import of nanoinfer's in a file: `from nanoinfer.a import b` is
    an import of the module nanoinfer.a.b if there is one, else of nanoinfer.a (a relative
    import, `from ..a import b`, is read as the absolute one it is)."""
    found = []
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{module}.{a.name}" if f"{module}.{a.name}" in known
                       else module) for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) in ("import_module", "__import__"):
            found.append((node.lineno, "a dynamic import: name its module in an import"))
    return found


def room_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_the_room_list_names_every_room():
    listed = set(rooms())
    present = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py")))}
    assert listed == present, (listed ^ present)


def test_no_room_imports_one_above_it_or_beside_it():
    levels, known = rooms(), modules()
    wrong = []
    for module, path in known.items():
        here = room_of(module)
        for line, target in imports(path, known):
            assert not target.startswith("a dynamic"), f"{path.relative_to(ROOT)}:{line}: {target}"
            if not target.startswith("nanoinfer"):
                continue
            there = room_of(target)
            if there != here and levels[there] <= levels[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({there}/ is "
                             f"{'above' if levels[there] < levels[here] else 'beside'} {here}/)")
    assert not wrong, "\n".join(wrong)


def test_no_modules_import_each_other_in_a_circle():
    known = modules()
    graph = {m: {t for _, t in imports(p, known) if t in known and t != m}
             for m, p in known.items()}

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            if (m := todo.pop()) not in seen:
                seen.add(m)
                todo += graph[m]
        return seen
    circles = sorted(m for m in known if m in reaches(m))
    assert not circles, f"these modules import themselves through others: {circles}"


def test_nanoinfer_imports_none_of_the_tools_beside_it():
    known = modules()
    for path in known.values():
        for line, target in imports(path, known):
            top = target.split(".")[0]
            assert top not in ("view", "course", "tests", "bench", "docs"), \
                f"{path.relative_to(ROOT)}:{line} imports {target}"


def test_the_package_imports_and_runs_without_triton(llama_dir):
    """Triton made unimportable, as on macOS or Windows: the CPU path still samples, applies a
    grammar's mask and answers."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None   # (any import of it now raises ImportError)
        from nanoinfer import GuidedDecodingParams, LLM, SamplingParams
        llm = LLM({llama_dir!r}, device="cpu")
        params = [SamplingParams(temperature=0.8, seed=1, max_tokens=4),
                  SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[ab]+"))]
        outs = llm.generate(["Hello", "Hello"], params, use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 4
        assert set(outs[1].outputs[0].text) <= set("ab"), outs[1].outputs[0].text
        assert not any(name.startswith("triton") for name in sys.modules if sys.modules[name])
        print("ok")
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
