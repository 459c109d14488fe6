"""`python -m view RUN.jsonl`: the engine you can watch, from the repository root.

    python -m view RUN.jsonl [--port P]         a recording (LLM(..., event_log=PATH), or
                                               serve --event-log PATH), on a local page
    python -m view RUN.jsonl --perfetto OUT.json   the same as a trace for ui.perfetto.dev
    python -m view --demo [--port P]           the demonstration (demo.py), recorded, then shown
    python -m view --live URL [--api-key KEY] [--core N]   a nanoinfer server, as it runs

Every page is served by this command, on 127.0.0.1; the engine's part is the log and the
server's stream alone (nanoinfer/engine/event_log.py).
"""
import argparse
import os
import sys
import tempfile

from view import demo, live, perfetto, server
from view.recording import Recording
from view.replay import BadLog


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m view", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", nargs="?", help="an event log (JSON lines)")
    parser.add_argument("--demo", action="store_true", help="record the demonstration, show it")
    parser.add_argument("--live", metavar="URL", help="a nanoinfer server to follow")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")
    parser.add_argument("--core", type=int, default=0, help="which engine core (data parallel)")
    parser.add_argument("--perfetto", metavar="OUT", help="write a Perfetto trace, serve nothing")
    parser.add_argument("--port", type=int, default=0, help="the page's port (default: a free one)")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.log, args.demo, args.live))) != 1:
        parser.error("give one of: a log, --demo, --live URL")
    if args.live:
        return server.serve(live.start(args.live, args.core, args.api_key), args.port) and 0
    path = args.log
    if args.demo:
        path = os.path.join(tempfile.mkdtemp(prefix="nanoinfer-view-"), "demo.jsonl")
        print(f"view: running the demonstration (about a minute on a CPU), recorded to {path}",
              flush=True)
        demo.record(path)
    try:
        if args.perfetto:
            steps, error = perfetto.export(path, args.perfetto)
            print(f"view: {steps} steps written to {args.perfetto} (open it in ui.perfetto.dev)")
            if error is not None:
                print(f"view: {path}: the trace stops at a bad line: {error}", file=sys.stderr)
            return 0
        recording = Recording.read(path)
    except (OSError, BadLog) as e:   # (the log's fault, said by its line; never a traceback)
        print(f"view: {path}: {e}", file=sys.stderr)
        return 1
    if recording.error is not None and not recording.windows:
        print(f"view: {path}: {recording.error}", file=sys.stderr)
        return 1
    if recording.error is not None:
        print(f"view: {path}: read up to a bad line, shown up to there: {recording.error}",
              file=sys.stderr)
    server.serve(recording, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
