"""What each part of nanoinfer costs in code lines: the tables of docs/ARCHITECTURE.md.

A code line holds a token that is neither a comment nor part of a docstring (blank lines,
comments and docstrings are free: they teach). Two tables come out of the tree:

- the base engine's reading order: the lines of each row's files (the rows are read from
  ARCHITECTURE.md itself, `layers/` but `sampler.py` style);
- each optional mechanism: the lines of its own files, and of its hooks, the named functions
  in other files that exist only for it (most of them in base-engine files, whose row counts
  them too).

    python docs/costs.py            # print the figures: the reading order's rows, the mechanisms'
    python docs/costs.py --write    # put them into docs/ARCHITECTURE.md
    python docs/costs.py --check    # exit 1 if ARCHITECTURE.md's figures are not the tree's
"""
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoinfer"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
FREE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENDMARKER}

# chapter -> (its own files and folders, its hooks: "file:Class.method" or "file:function")
MECHANISMS = {
    "GPU path: CUDA graphs and Triton kernels": (
        ["worker/cuda_graph.py", "kernels/", "attention/triton_backend.py"],
        ["worker/kv_cache.py:profile_free_memory"]),
    "9. Tensor parallelism (worker processes, shared-memory step message)": (
        ["executor/message_queue.py", "executor/multiproc_executor.py"],
        ["worker/model_runner.py:ModelRunner.receive_tokens",
         "worker/model_runner.py:ModelRunner.min_over_ranks"]),
    "10. Speculative decoding": (
        ["spec_decode/"],
        ["core/scheduler_hooks.py:SchedulerHooks.schedule_drafts",
         "core/scheduler_hooks.py:SchedulerHooks.drafts_that_fit",
         "core/scheduler_hooks.py:SchedulerHooks.settle_drafts",
         "core/scheduler_hooks.py:SchedulerHooks.next_drafts",
         "worker/input_batch.py:draft_rows",
         "worker/input_batch.py:InputBatch.num_drafts",
         "worker/input_batch.py:InputBatch.draft_inputs",
         "worker/input_batch.py:InputBatch.eagle_inputs",
         "worker/model_runner.py:ModelRunner.propose_drafts"]),
    "11. Structured output": (
        ["structured_output/", "kernels/bitmask.py"],
        ["core/scheduler_hooks.py:SchedulerHooks.add_grammar",
         "core/scheduler_hooks.py:SchedulerHooks.has_guided",
         "core/scheduler_hooks.py:SchedulerHooks.guided_samples",
         "core/scheduler_hooks.py:SchedulerHooks.grammar_ready",
         "core/scheduler_hooks.py:SchedulerHooks.take_unstepped_outputs",
         "engine/core.py:StepsInFlight.finish_for_grammar",
         "engine/input_processor.py:InputProcessor.grammar",
         "worker/sampling_inputs.py:SamplingInputs.grammar_rows"]),
    "12. Serving (AsyncLLM, the core's process, data parallelism, the HTTP server)": (
        ["engine/async_llm.py", "engine/core_client.py", "engine/exceptions.py",
         "entrypoints/openai_server.py", "entrypoints/protocol.py", "entrypoints/http.py",
         "entrypoints/metrics.py", "serve.py"],
        []),
    "13. Pipeline parallelism": (
        [],
        ["config.py:stage_layers",
         "worker/model_runner.py:ModelRunner.intermediate",
         "distributed.py:GroupCoordinator.send_next",
         "distributed.py:GroupCoordinator.recv_prev"]),
    "13. Multi-node (stages and data-parallel cores on several nodes, over authenticated links)": (
        ["executor/multinode.py", "executor/node_link.py"],
        ["config.py:Config.check_nodes",
         "executor/multiproc_executor.py:MultiprocExecutor.send",
         "engine/core_client.py:EngineCoreClient.ended",
         "serve.py:check_nodes"]),
    "14. KV connectors and disaggregated serving": (
        ["kv_transfer/", "entrypoints/disagg_proxy.py"],
        ["core/scheduler_hooks.py:SchedulerHooks.external_blocks",
         "core/scheduler_hooks.py:SchedulerHooks.load_external",
         "core/scheduler_hooks.py:SchedulerHooks.save_external",
         "worker/model_runner.py:ModelRunner.load_kv",
         "worker/model_runner.py:ModelRunner.save_kv"]),
    "15. The event log (the view's part inside the engine; view/ is beside it)": (
        ["engine/event_log.py"],
        ["engine/core.py:EngineCore.watch",
         "engine/async_llm.py:AsyncLLM.watch",
         "engine/async_llm.py:AsyncLLM.stop_watching",
         "entrypoints/openai_server.py:create_app.engine_events"]),
    "Prompt logprobs": (
        [],
        ["core/scheduler_hooks.py:SchedulerHooks.computed_blocks",
         "core/scheduler_hooks.py:SchedulerHooks.update_prompts",
         "worker/input_batch.py:InputBatch.prompt_positions",
         "worker/model_runner.py:ModelRunner.score_prompts",
         "worker/async_output.py:AsyncModelRunnerOutput.prompt_rows",
         "layers/sampler.py:score_prompt_tokens"]),
    "Settings, checked (config.py, sampling_params.py), and the default model": (
        ["config.py", "sampling_params.py", "default_model.py"],
        []),
}


def code_lines(src: str) -> set[int]:
    """The numbers of the lines of `src` that hold code."""
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in FREE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def file_cost(path: Path) -> int:
    return len(code_lines(path.read_text(encoding="utf-8")))


def files_of(names: list[str], drops: set[str] = frozenset()) -> set[Path]:
    """The files that `names` (files, or folders ending in /) name, less those named `drops`."""
    files = set()
    for name in names:
        path = PACKAGE / name
        if not path.exists():
            raise SystemExit(f"docs/costs.py names {name}, which nanoinfer/ does not have")
        found = sorted(path.rglob("*.py")) if name.endswith("/") else [path]
        files |= {p for p in found if p.name not in drops}
    return files


def hook_cost(hook: str) -> int:
    """The code lines of one named function or method ("file:Class.method")."""
    name, _, qualname = hook.partition(":")
    src = (PACKAGE / name).read_text(encoding="utf-8")
    node = ast.parse(src)
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part),
                    None)
        if node is None:
            raise SystemExit(f"docs/costs.py names the hook {hook}, which is not there")
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return len(code_lines(src) & set(range(first, node.end_lineno + 1)))


def base_rows(doc: str) -> list[tuple[str, set[Path]]]:
    """The reading-order table's rows 1-8: (the row's number, its files)."""
    rows = []
    section = doc[doc.index("## Reading order"):]
    section = section[:section.index("\n## ")]
    for number, cell in re.findall(r"^\| ([1-8]) \| (.*?) \|", section, re.M):
        keep, _, drop = cell.replace("`", "").partition(" but ")
        drops = {d.strip() for d in drop.split(",") if d.strip()}
        rows.append((number, files_of([n.strip() for n in keep.split(",")], drops)))
    return rows


def mechanism_table() -> str:
    lines = ["| mechanism | its own files | hooks elsewhere | in all |", "|---|---|---|---|"]
    for chapter, (own, hooks) in MECHANISMS.items():
        own_lines = sum(file_cost(p) for p in files_of(own))
        hook_lines = sum(hook_cost(h) for h in hooks)
        functions = "function" if len(hooks) == 1 else "functions"
        lines.append(f"| {chapter} | {own_lines:,} | {hook_lines:,} ({len(hooks)} {functions}) "
                     f"| {own_lines + hook_lines:,} |")
    return "\n".join(lines)


def updated_doc(doc: str) -> str:
    """ARCHITECTURE.md with the tree's figures: each reading-order row's lines, the base
    engine's and the package's totals, and the mechanisms' table between its markers."""
    base = set()
    for number, files in base_rows(doc):
        base |= files
        cost = sum(file_cost(p) for p in files)
        doc = re.sub(rf"^(\| {number} \| `.*\| )[\d,]+ \|$", rf"\g<1>{cost:,} |", doc,
                     count=1, flags=re.M)
    total = sum(file_cost(p) for p in PACKAGE.rglob("*.py"))
    doc = re.sub(r"(base engine: )[\d,]+( code lines)",
                 rf"\g<1>{sum(file_cost(p) for p in base):,}\g<2>", doc)
    doc = re.sub(r"(all of nanoinfer/: )[\d,]+( code lines)", rf"\g<1>{total:,}\g<2>", doc)
    return re.sub(r"(<!-- costs -->\n).*?(<!-- /costs -->)",
                  lambda m: m.group(1) + mechanism_table() + "\n" + m.group(2), doc, flags=re.S)


def main() -> None:
    doc = DOC.read_text(encoding="utf-8")
    new = updated_doc(doc)
    if "--write" in sys.argv:
        DOC.write_text(new, encoding="utf-8")
    elif "--check" in sys.argv:
        if new != doc:
            sys.exit("docs/ARCHITECTURE.md's code-line figures are out of date: run "
                     "python docs/costs.py --write")
    else:
        for number, files in base_rows(doc):
            print(f"row {number}: {sum(file_cost(p) for p in files):,} code lines")
        print(re.search(r"The base engine: .*? code lines", new).group(0))
        print(re.search(r"all of nanoinfer/: .*? code lines", new).group(0))
        print(mechanism_table())


if __name__ == "__main__":
    main()
