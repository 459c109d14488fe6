"""The nanoinfer course: assignments that take one mechanism out of the engine, and the grader
that scores a student's version of it. Run it from the project root: `python -m course list`.
See course/README.md."""
