"""The course is gradable: for every assignment, `start` blanks it and the engine still imports,
`check` then fails every criterion (the blanked code raising its NotImplementedError), `reset`
puts back exactly the committed files, and `check` then scores 100. The assignments that no
engine run needs are started together and graded blanked in one process; each half of the
course is graded restored in one process.

It runs the grader's own commands, as a student would, in a copy of the project committed to a
git repository of its own (so the tree under test is never touched).
"""
import ast
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from course.assignments import ASSIGNMENTS, get
from course.blanking import blank_functions, find_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def course(copy: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course", *args], cwd=copy, text=True,
                          capture_output=True, env=dict(os.environ, PYTHONPATH=copy),
                          timeout=600)


def git(copy: str, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=course", "-c", "user.email=course@localhost",
                           *args], cwd=copy, check=True, capture_output=True, text=True).stdout


def make_copy(copy: str) -> str:
    """The project's code, course and test fixtures, committed in a repository of their own."""
    ignore = shutil.ignore_patterns("__pycache__", ".state", ".backup")
    for folder in ("nanoinfer", "course"):
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(copy, folder), ignore=ignore)
    os.makedirs(os.path.join(copy, "tests"))
    for path in ("pyproject.toml", ".gitignore", "tests/conftest.py"):
        shutil.copyfile(os.path.join(ROOT, path), os.path.join(copy, path))
    git(copy, "init", "-q")
    git(copy, "add", "-A")
    git(copy, "commit", "-q", "-m", "the project")
    return copy


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    return [make_copy(str(tmp_path_factory.mktemp("course") / "project")) for _ in range(2)]


def sections(output: str) -> dict[int, str]:
    """A check's report, by assignment."""
    parts = re.split(r"^assignment (\d+): ", output, flags=re.M)
    return {int(n): section for n, section in zip(parts[1::2], parts[2::2])}


# Blanked, each of these takes out a piece that every engine run needs (the block manager, the
# scheduler, the torch attention the CPU runs, sampling, detokenizing, the linear layers' weight
# loading): another assignment's criteria would fail on it before reaching their own code. The
# others are started together and graded in one process.
NEEDED_BY_EVERY_RUN = {1, 2, 3, 4, 6, 7, 8}


def prove(copy: str, numbers: list[int]) -> dict[int, dict]:
    """For each group of `numbers`: start its assignments, check them blanked in one process,
    reset each and take git status; then check all of `numbers` again in one process. The
    grader's outputs, by assignment."""
    alone = [[n] for n in numbers if n in NEEDED_BY_EVERY_RUN]
    together = [n for n in numbers if n not in NEEDED_BY_EVERY_RUN]
    out = {}
    for group in alone + ([together] if together else []):
        started = {n: course(copy, "start", str(n)) for n in group}
        blanked = course(copy, "check", *map(str, group))
        reset = {n: course(copy, "reset", str(n)) for n in group}
        status = git(copy, "status", "--porcelain")
        blanked_sections = sections(blanked.stdout)
        for n in group:
            out[n] = dict(started=started[n], checked=blanked, blanked=blanked_sections.get(n, ""),
                          reset=reset[n], status=status)
    final = course(copy, "check", *map(str, numbers))
    for n, section in sections(final.stdout).items():
        out[n].update(final=section, final_rc=final.returncode)
    return out


@pytest.fixture(scope="module")
def proofs(copies) -> dict[int, dict]:
    """Every assignment proved, half in each copy, the two halves at once (two CPU cores).
    Assignments 2 and 3 blank the same file: they fall in different halves."""
    numbers = [a.number for a in ASSIGNMENTS]
    halves = [numbers[0::2], numbers[1::2]]
    for half in halves:
        files = [path for n in half for path in get(n).files]
        assert len(files) == len(set(files)), f"assignments {half} share a file"
    with ThreadPoolExecutor(2) as pool:
        proved = pool.map(prove, copies, halves)
    return {n: proof for half in proved for n, proof in half.items()}


def criteria(output: str) -> list[tuple[str, str]]:
    return re.findall(r"^  \[(pass|FAIL)\] (.*)$", output, re.M)


@pytest.mark.parametrize("number", [a.number for a in ASSIGNMENTS])
def test_blanked_assignment_fails_every_criterion(proofs, number):
    proof = proofs[number]
    started, checked = proof["started"], proof["checked"]
    # `start` imports the engine and the blanked modules, and undoes itself if that fails.
    assert started.returncode == 0, started.stdout + started.stderr
    found = criteria(proof["blanked"])
    assert checked.returncode != 0
    assert found and all(outcome == "FAIL" for outcome, _ in found), checked.stdout
    # (every criterion ran and failed: one the session never reached proves nothing)
    assert "(not run" not in proof["blanked"], checked.stdout
    assert f"NotImplementedError: assignment {number}: write" in checked.stdout
    assert "score: 0/100" in proof["blanked"]
    assert proof["reset"].returncode == 0, proof["reset"].stdout
    # `reset` put back exactly the committed files.
    assert proof["status"] == ""


@pytest.mark.parametrize("number", [a.number for a in ASSIGNMENTS])
def test_reset_assignment_scores_100(proofs, number):
    section = proofs[number].get("final", "")
    found = criteria(section)
    assert found and all(outcome == "pass" for outcome, _ in found), section
    assert "score: 100/100" in section
    assert proofs[number].get("final_rc") == 0


@pytest.mark.parametrize("number", [a.number for a in ASSIGNMENTS])
def test_blanking_changes_only_the_listed_bodies(number):
    """Signatures, docstrings and every other line stay: the syntax trees of the original and
    the blanked file are equal once the listed functions' bodies are set aside."""
    assignment = get(number)
    for path in assignment.files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            original = f.read()
        names = assignment.functions_in(path)
        blanked = blank_functions(original, names, f"assignment {number}")
        trees = [ast.parse(original), ast.parse(blanked)]
        for tree in trees:
            for name in names:
                function = find_function(tree, name)
                docstring = ast.get_docstring(function, clean=False)
                function.body = [ast.Constant(docstring)]
        assert ast.dump(trees[0]) == ast.dump(trees[1])
        for name in names:
            body = find_function(ast.parse(blanked), name).body
            assert isinstance(body[-1], ast.Raise) and len(body) <= 2


def test_start_and_reset_keep_a_students_work(copies):
    """`start` refuses over uncommitted changes; `reset` refuses over edits unless forced, and
    then keeps them."""
    copy = copies[0]
    path = os.path.join(copy, "nanoinfer/spec_decode/ngram_proposer.py")
    with open(path, "a") as f:
        f.write("# work in progress\n")
    refused = course(copy, "start", "9")
    assert refused.returncode != 0 and "uncommitted" in refused.stdout
    git(copy, "checkout", "--", ".")
    assert course(copy, "start", "9").returncode == 0
    with open(path, "a") as f:
        f.write("# my version\n")
    assert course(copy, "reset", "9").returncode != 0
    forced = course(copy, "reset", "9", "--force")
    assert forced.returncode == 0 and git(copy, "status", "--porcelain") == ""
    backups = [os.path.join(dirpath, name) for dirpath, _, names
               in os.walk(os.path.join(copy, "course", ".backup")) for name in names]
    assert len(backups) == 1 and open(backups[0]).read().endswith("# my version\n")
