"""`python -m nanoinfer.serve --model PATH [--port 8000] [--host 127.0.0.1] [--api-key KEY]
[--data-parallel-size N] [--max-request-bytes N] [--shutdown-timeout S] [engine options]`: the
OpenAI-compatible server (entrypoints/). With `--headless` (and `--nnodes N --node-rank R
--master-addr HEAD --master-port PORT`), a node of a model over several nodes: its ranks only.

Every engine option of `Config` is a flag of the same name in vLLM's spelling
(`--max-model-len 4096`, `--tensor-parallel-size 2`, `--enable-prefix-caching` /
`--no-enable-prefix-caching`, ...). It binds 127.0.0.1 unless told otherwise. Without `--model`
it serves the embedded default model under the name `SmolLM2-135M-Instruct`. On SIGTERM (or
Ctrl-C) it stops accepting, gives the requests in flight `--shutdown-timeout` seconds to finish,
aborts the rest, stops its engine cores and exits with status 0.
"""
import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import typing

import torch
import uvicorn

from nanoinfer.config import Config
from nanoinfer.utils import exit_now


# The server's own flags: (flag, type, default, help). Every setting of Config is one too.
SERVER_FLAGS = [
    ("--model", str, None, "a Hugging Face model folder (default: SmolLM2)"),
    ("--served-model-name", str, None, "the name clients use (default: --model)"),
    ("--host", str, "127.0.0.1", "the address to listen at"),
    ("--port", int, 8000, None),
    ("--api-key", str, None, "require 'Authorization: Bearer KEY' on /v1 routes"),
    ("--data-parallel-size", int, 1, "engine-core processes"),
    ("--data-parallel-size-local", int, None, "of them on this node (default: all)"),
    ("--data-parallel-start-rank", int, 0, "a headless node's first core"),
    ("--data-parallel-address", str, "127.0.0.1", "the head's, where other nodes' cores join"),
    ("--data-parallel-rpc-port", int, None, "... and its port"),
    ("--max-request-bytes", int, 4 * 2**20, "larger bodies: a 413"),
    ("--shutdown-timeout", float, 5.0, "seconds the requests in flight get to finish on SIGTERM"),
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanoinfer.serve",
                                     description=__doc__.split("\n\n")[0])
    for flag, kind, default, text in SERVER_FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--headless", action="store_true",
                        help="this node's ranks (--nnodes) or cores only, for another's front end")
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        kind = (typing.get_args(hints[f.name]) or [hints[f.name]])[0]
        if not f.init or f.name == "model" or kind not in (int, float, str, bool, dict):
            continue
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=json.loads if kind is dict else kind, default=f.default)
    args = parser.parse_args(argv)
    check_nodes(parser, args)
    return args


def check_nodes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nodes of a model (--nnodes) or of data-parallel cores (--data-parallel-rpc-port)."""
    size = args.data_parallel_size
    start = args.data_parallel_start_rank
    local = size - start if args.data_parallel_size_local is None else args.data_parallel_size_local
    args.data_parallel_size_local = local
    of_model = args.nnodes > 1 and args.node_rank >= 1
    of_cores = args.nnodes == 1 and start >= 1 and args.data_parallel_rpc_port is not None
    if args.headless != (of_model or of_cores):
        parser.error("--headless is a node other than the head: of a model (--node-rank >= 1) "
                     "or of cores (--data-parallel-start-rank >= 1, --data-parallel-rpc-port)")
    if not 1 <= local <= size - start:
        parser.error(f"--data-parallel-size-local {local} from --data-parallel-start-rank {start}: "
                     f"1 or more cores within --data-parallel-size {size}")
    if local < size and args.data_parallel_rpc_port is None:
        parser.error("cores on other nodes need --data-parallel-rpc-port (--data-parallel-address)")


def run_node(args: argparse.Namespace, options: dict, address: tuple) -> int:
    """A headless node's exit status: it runs a model's ranks (--nnodes) or data-parallel cores."""
    from nanoinfer.engine.core_client import run_headless_cores
    from nanoinfer.executor import multinode
    cores = range(args.data_parallel_start_rank,
                  args.data_parallel_start_rank + args.data_parallel_size_local)
    try:
        config = Config(args.model, **options)
        return (multinode.run_headless(config) if args.nnodes > 1
                else run_headless_cores(config, address, cores))
    except KeyboardInterrupt:   # (its ranks stop with it)
        print("nanoinfer: node stopped", flush=True)
        return 130
    except Exception as e:   # (no head, a wrong key, refused: the message says which)
        print(f"nanoinfer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


class Server(uvicorn.Server):
    """uvicorn's server, stopping as a server should: on SIGTERM or Ctrl-C it stops accepting and
    gives the requests in flight `shutdown_timeout` seconds; then it aborts those still running
    itself, so that each ends as an abort does (a stream with its last chunk, finish_reason
    "abort", and [DONE]) and uvicorn has nothing to cancel (its own timeout, later, is only a
    backstop)."""

    def __init__(self, app, args: argparse.Namespace, engine):
        super().__init__(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                        timeout_graceful_shutdown=args.shutdown_timeout + 5))
        self.engine = engine
        self.shutdown_timeout = args.shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine.abort_all)
        await super().shutdown(sockets)


def start_engine(args: argparse.Namespace):
    """The engine (AsyncLLM) and the served model's name; or, for a headless node, its run."""
    from nanoinfer.engine.async_llm import AsyncLLM
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    if args.model is None:   # the embedded default model
        from nanoinfer.default_model import default_model_path
        args.model = default_model_path()
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if f.init and f.name != "model" and hasattr(args, f.name)}
    address = (args.data_parallel_address, args.data_parallel_rpc_port)
    if args.headless:   # a node of a model's ranks or of data-parallel cores: no front end
        sys.exit(run_node(args, options, address))
    engine = AsyncLLM(args.model, data_parallel_size=args.data_parallel_size,
                      data_parallel_size_local=args.data_parallel_size_local,
                      data_parallel_address=address, **options)
    return engine, name


def main(argv=None) -> None:
    from nanoinfer.entrypoints.openai_server import create_app
    args = parse_args(argv)
    # This process runs no model (its engine cores do, each on its share of the cores: vLLM's
    # rule): threads of its own would only take the CPU from theirs.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    # SIGTERM while the engine starts is a Ctrl-C: the cores started so far are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        engine, name = start_engine(args)
    except KeyboardInterrupt:
        print("nanoinfer: stopped while starting", flush=True)
        return
    try:
        server = Server(create_app(engine, name, args.api_key, args.max_request_bytes), args,
                        engine)
        c = engine.config
        key = ", API key required" if args.api_key else ""
        print(f"nanoinfer: serving {name!r} at http://{args.host}:{args.port}/v1 (max_model_len="
              f"{c.max_model_len}, data parallel {args.data_parallel_size}, tensor parallel "
              f"{c.tensor_parallel_size}, pipeline parallel {c.pipeline_parallel_size}, "
              f"{c.device}, {str(c.torch_dtype).removeprefix('torch.')}{key})", flush=True)
        # uvicorn takes SIGINT and SIGTERM while it serves; once it has stopped it raises the
        # signal again, to the handler that was there before it (by default: the end of the
        # process, before the finally below stops the engine cores, and a status of 143 or 130).
        # That handler is the server's own, which by then does nothing: the cores stop, exit 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)
        server.run()
    except KeyboardInterrupt:   # (a stop before uvicorn took the signals)
        pass
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
    # The engine cores are stopped and the sockets closed; the resource tracker goes too.
    exit_now(0, stop_tracker=True)
