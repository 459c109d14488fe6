"""The front end's errors, shared by the offline engine, AsyncLLM, the core client, the server."""


class EngineDeadError(RuntimeError):
    """The engine can serve no more: its core died, a step was cut off, or it was shut down."""
