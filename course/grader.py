"""start, check and reset: the grader's three verbs.

`start N` saves the original of every file assignment N touches (under course/.state/NN/),
blanks the assignment's functions (blanking.py), and checks that the engine still imports; it
refuses to run over uncommitted changes to those files, so a student never loses work.
`check N` runs the assignment's grading tests (course/grading/) in a fresh Python process and
prints each criterion, pass or fail, and a score out of 100. `reset N` puts the originals back;
it refuses when the student has edited a blanked function, unless forced, and then keeps a copy
of the student's version (course/.backup/).

A criterion is one test function (all its parametrized cases must pass); its name is the first
line of its docstring. The GPU criteria are the tests marked `gpu`: `check N --gpu` runs those
alone, on a machine with a CUDA GPU.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from course.assignments import ASSIGNMENTS, Assignment
from course.blanking import blank_functions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state_dir(assignment: Assignment, kind: str = "") -> str:
    return os.path.join(ROOT, "course", ".state", f"{assignment.number:02d}", kind)


def read(path: str) -> str:
    # (newline="": line endings stay as they are, CRLF too)
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def uncommitted(paths: list[str]) -> list[str] | None:
    """Those of `paths` with changes git has not committed; None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    try:
        if git("rev-parse", "--is-inside-work-tree").returncode != 0:
            return None
    except OSError:   # (no git at all)
        return None
    result = git("status", "--porcelain", "--", *paths)
    if result.returncode != 0:   # a checkout git cannot read: assume the worst
        return [f"(git status failed: {result.stderr.strip()})"]
    return [line[3:] for line in result.stdout.splitlines()]


def modules(paths: list[str]) -> list[str]:
    return [p[:-len(".py")].replace("/", ".") for p in paths]


def import_error(paths: list[str]) -> str | None:
    """Why the engine (and these files' modules) no longer import, or None."""
    names = ["nanoinfer", "nanoinfer.entrypoints.llm", *modules(paths)]
    code = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode == 0:
        return None
    return result.stderr.strip() or f"exit status {result.returncode}"


def refusal(assignment: Assignment) -> str | None:
    """Why `start` must not blank this assignment now, or None."""
    n = assignment.number
    if os.path.exists(state_dir(assignment)):
        return f"assignment {n} is started already; `python -m course reset {n}` ends it"
    for other in ASSIGNMENTS:
        shared = set(other.files) & set(assignment.files)
        if other is not assignment and shared and os.path.exists(state_dir(other)):
            return (f"assignment {other.number} is started and blanks {', '.join(shared)} too; "
                    f"finish it and `python -m course reset {other.number}` first")
    for path in assignment.files:
        if f'NotImplementedError("assignment {n}: write' in read(os.path.join(ROOT, path)):
            return (f"{path} is blanked already, but assignment {n} is not started (was "
                    "course/.state/ deleted?): `git checkout` the original first")
    return None


def start(assignment: Assignment) -> int:
    n = assignment.number
    reason = refusal(assignment)
    if reason is not None:
        print(reason)
        return 1
    changed = uncommitted(assignment.files)
    if changed:
        print("these files have uncommitted changes; commit or stash them first, so that "
              "nothing of yours is lost:\n  " + "\n  ".join(changed))
        return 1
    if changed is None:
        print("(not a git checkout: the originals are saved under course/.state/ all the same)")
    # Every file is blanked in memory first: if one cannot be, nothing changes.
    originals = {path: read(os.path.join(ROOT, path)) for path in assignment.files}
    try:
        blanked = {path: blank_functions(text, assignment.functions_in(path), f"assignment {n}")
                   for path, text in originals.items()}
    except (LookupError, SyntaxError) as e:
        print(f"cannot blank assignment {n}'s functions; nothing was changed: {e}")
        return 1
    for path in assignment.files:
        write(os.path.join(state_dir(assignment, "original"), path), originals[path])
        write(os.path.join(state_dir(assignment, "blanked"), path), blanked[path])
    for path in assignment.files:
        shutil.copyfile(os.path.join(state_dir(assignment, "blanked"), path),
                        os.path.join(ROOT, path))
    error = import_error(assignment.files)
    if error is not None:
        restore(assignment)
        print(f"blanking broke the engine's import; nothing was changed:\n{error}")
        return 1
    print(f"assignment {n}: {assignment.title}. Read {assignment.doc}; write these functions:")
    for function in assignment.functions:
        print(f"  {function}")
    print(f"then `python -m course check {n}`. Commit the blanked files now (`git commit -am "
          f"'start assignment {n}'`): until you do, `git diff` shows the engine's own code, the "
          "reference answer.")
    return 0


def edited(assignment: Assignment) -> list[str]:
    """The files the student changed since `start`."""
    return [path for path in assignment.files
            if read(os.path.join(ROOT, path)) != read(os.path.join(state_dir(assignment,
                                                                             "blanked"), path))]


def restore(assignment: Assignment) -> None:
    for path in assignment.files:
        shutil.copyfile(os.path.join(state_dir(assignment, "original"), path),
                        os.path.join(ROOT, path))
    shutil.rmtree(state_dir(assignment))


def reset(assignment: Assignment, force: bool = False) -> int:
    n = assignment.number
    if not os.path.exists(state_dir(assignment)):
        print(f"assignment {n} is not started: nothing to reset")
        return 1
    changed = edited(assignment)
    if changed and not force:
        print("you have edited these files since `start`; `reset --force` throws your version "
              "away (keeping a copy under course/.backup/):\n  " + "\n  ".join(changed))
        return 1
    if changed:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = os.path.join(ROOT, "course", ".backup", f"{n:02d}-{stamp}")
        for path in changed:
            write(os.path.join(backup, path), read(os.path.join(ROOT, path)))
        print(f"your version is kept in {os.path.relpath(backup, ROOT)}")
    restore(assignment)
    print(f"assignment {n}: the original code is back")
    return 0


def run_tests(assignments: list[Assignment], gpu: bool) -> dict:
    """Run the grading tests in a fresh process; each test's outcome and docstring by node id."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        env = dict(os.environ, COURSE_REPORT=report, PYTHONPATH=ROOT, PYTEST_ADDOPTS="")
        # A test that hangs (a loop that makes no progress) fails after 90 s, and the whole run
        # stops after 6 minutes: a half-written solution cannot keep the grader busy for long.
        subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "course.report",
                        "-p", "no:cacheprovider", "--continue-on-collection-errors",
                        "-m", "gpu" if gpu else "not gpu", "--timeout", "90",
                        "--session-timeout", "360", *[a.tests for a in assignments]],
                       cwd=ROOT, env=env)
        if not os.path.exists(report):
            return {}
        with open(report) as f:
            return json.load(f)


def criteria(results: dict, assignment: Assignment) -> dict[str, tuple[str, str]]:
    """Each criterion (a test function, all its cases) of `assignment`: its name and "pass"
    if every case passed, else "FAIL" (or "not run", if a case never ran)."""
    out = {}
    for node_id, (outcome, doc) in results.items():
        if not node_id.startswith(assignment.tests):
            continue
        function = node_id.split("[")[0]
        name, verdict = out.get(function, (doc or function.split("::")[-1], "pass"))
        if verdict != "FAIL" and outcome != "passed":
            verdict = "not run" if outcome == "not run" else "FAIL"
        out[function] = (name, verdict)
    return out


def check(assignments: list[Assignment], gpu: bool = False) -> int:
    if gpu and not has_cuda():
        print("there is no CUDA GPU here: the GPU criteria need one")
        return 2
    if gpu:
        assignments = [a for a in assignments if a.has_gpu_criteria]
        if not assignments:
            print("these assignments have no GPU criteria")
            return 0
    results = run_tests(assignments, gpu)
    all_full = True
    for assignment in assignments:
        found = criteria(results, assignment)
        passed = sum(verdict == "pass" for _, verdict in found.values())
        score = round(100 * passed / len(found)) if found else 0
        all_full &= bool(found) and passed == len(found)
        kind = "GPU criteria" if gpu else "criteria"
        print(f"\nassignment {assignment.number}: {assignment.title} ({kind})")
        for name, verdict in found.values():
            print(f"  [{verdict if verdict != 'not run' else 'FAIL'}] {name}"
                  + (" (not run: see above)" if verdict == "not run" else ""))
        if not found:
            print("  (the grading tests did not run: see the errors above)")
        print(f"  score: {score}/100")
    return 0 if all_full else 1


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
