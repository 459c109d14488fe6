"""The engine you can watch: nanoinfer's event log, replayed and drawn, beside the engine.

The engine core writes what it does (nanoinfer/engine/event_log.py): every step, every block it
allocates or frees, every request. This package reads that and nothing else: `replay.py` rebuilds
the state after any step, `recording.py` cuts a long log into windows, `server.py` serves the
page (`page.html`), `live.py` follows a running server, `perfetto.py` writes a trace, and
`demo.py` records a run that shows the base engine's mechanisms. `python -m view --help`.

Nothing in nanoinfer/ imports this package; it imports nanoinfer only to run the demonstration.
"""
