"""The live page's feed: a nanoinfer server's stream of one engine core's records, followed.

The server (`python -m nanoinfer.serve`) streams them at `GET /engine/events?core=N` as
server-sent events, behind its `--api-key`, only while someone listens: the core records nothing
otherwise. The stream opens with a header and a snapshot of the core's state, then every record
as it is made. One that falls behind is dropped by the server; this follower then connects again
and starts over from a new snapshot (as it does when the server restarts).
"""
import json
import threading
import urllib.request

from view.recording import Recording


def follow(url: str, recording: Recording, core: int = 0, api_key: str | None = None,
           stop: threading.Event | None = None) -> None:
    """Feed `recording` from the server at `url` until `stop` is set (reconnecting meanwhile);
    `recording.error` says why while it cannot."""
    stop = stop or threading.Event()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/engine/events?core={core}",
                                     headers=headers)
    while not stop.is_set():
        try:
            with urllib.request.urlopen(request, timeout=60) as stream:
                recording.error = None
                for line in stream:
                    if line.startswith(b"data: "):
                        recording.append(json.loads(line[6:]))
                    if stop.is_set():
                        return
            recording.error = f"{url} ended the stream (connecting again)"
        except (OSError, ValueError) as e:   # (refused, a 401, gone, a bad record)
            recording.error = f"the stream of {url}: {e} (connecting again)"
        stop.wait(1)


def start(url: str, core: int = 0, api_key: str | None = None) -> Recording:
    """A live recording, fed by a thread of its own."""
    recording = Recording()
    threading.Thread(target=follow, args=(url, recording, core, api_key), daemon=True,
                     name="view-live").start()
    return recording
