"""The view's own small HTTP server, on 127.0.0.1: the page, and what it asks for, as JSON.

    GET /                        the page (page.html: plain HTML and JavaScript, no build step)
    GET /api/info                the steps there are (first, last), the engine's shape, an error
    GET /api/state?step=N        the state after step N (recording.py's `state`)
    GET /api/timeline?window=W   the steps of window W, one row each

The same server serves a recording and, with `--live`, a nanoinfer server's stream (live.py):
the page never comes from inside the engine, whose only part is the stream of records.
"""
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from view.recording import Recording

PAGE = Path(__file__).with_name("page.html")


def make_handler(recording: Recording):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
            try:
                if url.path == "/":
                    return self.send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
                if url.path == "/api/info":
                    return self.send_json(200, recording.info())
                if url.path == "/api/state":
                    return self.send_json(200, recording.state(int(query["step"])))
                if url.path == "/api/timeline":
                    return self.send_json(200, recording.timeline(int(query["window"])))
                self.send_json(404, {"error": f"no such page: {url.path}"})
            except (KeyError, ValueError, IndexError) as e:
                self.send_json(404, {"error": f"{type(e).__name__}: {e}"})

        def send_json(self, status: int, body) -> None:
            self.send(status, json.dumps(body).encode(), "application/json")

        def send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):   # (quiet: the page asks every few hundred ms)
            pass
    return Handler


def serve(recording: Recording, port: int = 0, block: bool = True) -> ThreadingHTTPServer:
    """Serve `recording` at http://127.0.0.1:port (0: a free port); prints the URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(recording))
    server.daemon_threads = True
    print(f"view: http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)", flush=True)
    if not block:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("view: stopped", flush=True)
    finally:
        server.server_close()
    return server
