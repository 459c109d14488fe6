"""python -m course list | start N | check N [N ...] [--gpu] | reset N [--force]"""
import argparse
import os
import sys

from course.assignments import ASSIGNMENTS, get
from course.grader import check, reset, start, state_dir


def list_assignments() -> int:
    for a in ASSIGNMENTS:
        started = "  (started)" if os.path.exists(state_dir(a)) else ""
        print(f"{a.number:2d}. {a.title}{started}\n    {a.doc}; ARCHITECTURE.md: {a.chapter}")
    print("\npython -m course start N | check N [N ...] [--gpu] | reset N [--force]")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="the assignments")
    verbs.add_parser("start", help="blank assignment N's functions").add_argument("n", type=int)
    checker = verbs.add_parser("check", help="grade assignments, a score out of 100 each")
    checker.add_argument("n", type=int, nargs="+")
    checker.add_argument("--gpu", action="store_true", help="the GPU stretch criteria")
    resetter = verbs.add_parser("reset", help="put assignment N's original code back")
    resetter.add_argument("n", type=int)
    resetter.add_argument("--force", action="store_true", help="even over your edits")
    args = parser.parse_args()
    if args.verb == "list":
        return list_assignments()
    if args.verb == "start":
        return start(get(args.n))
    if args.verb == "check":
        return check([get(n) for n in args.n], args.gpu)
    return reset(get(args.n), args.force)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:   # (`python -m course list | head`)
        sys.exit(0)
