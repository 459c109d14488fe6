"""A pytest plugin that writes each grading test's outcome and criterion name to a JSON file.

The grader (grader.py) loads it into the pytest run it starts, with the file's path in the
COURSE_REPORT environment variable: {node id: [outcome, the first line of its docstring]}.
"""
import json
import os

outcomes: dict[str, list] = {}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        doc = (getattr(item, "function", None).__doc__ or "").strip().splitlines()
        outcomes[item.nodeid] = ["not run", doc[0] if doc else ""]


def pytest_deselected(items) -> None:
    # Tests that `-m` leaves out (the GPU criteria, or all but them) are not criteria of this run.
    for item in items:
        outcomes.pop(item.nodeid, None)


def pytest_runtest_logreport(report) -> None:
    entry = outcomes.setdefault(report.nodeid, ["not run", ""])
    # A failure in any phase (set-up, the test, tear-down) fails the test.
    if report.failed:
        entry[0] = "failed"
    elif report.when == "call" and entry[0] != "failed":
        entry[0] = report.outcome
    elif report.skipped and entry[0] == "not run":
        entry[0] = "skipped"


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("COURSE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(outcomes, f)
