"""The assignments: what each takes out of the engine, and where it is taught.

Each assignment names the engine's functions a student writes (`path:qualname`), the markdown
file that asks for them (`course/NN_slug.md`), the grading tests (`course/grading/
test_NN_slug.py`), the chapter of docs/ARCHITECTURE.md that explains the mechanism, and the
topic of "Inside vLLM" (Aleksa Gordić's walk through vLLM V1) that it follows.
"""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Assignment:
    number: int
    slug: str
    title: str
    functions: tuple[str, ...]
    chapter: str
    inside_vllm: str

    @property
    def doc(self) -> str:
        return f"course/{self.number:02d}_{self.slug}.md"

    @property
    def tests(self) -> str:
        return f"course/grading/test_{self.number:02d}_{self.slug}.py"

    @property
    def files(self) -> list[str]:
        """The engine's files it blanks functions in, in order."""
        return list(dict.fromkeys(f.split(":")[0] for f in self.functions))

    @property
    def has_gpu_criteria(self) -> bool:
        with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), self.tests)) as f:
            return "mark.gpu" in f.read()

    def functions_in(self, path: str) -> list[str]:
        return [f.split(":")[1] for f in self.functions if f.split(":")[0] == path]


CORE, WORKER = "nanoinfer/core", "nanoinfer/worker"

ASSIGNMENTS = [
    Assignment(1, "block_manager", "Prefix-cache hashing and the block manager", (
        f"{CORE}/sequence.py:Sequence.hash_full_blocks",
        f"{CORE}/block_manager.py:BlockManager.get_computed_blocks",
        f"{CORE}/block_manager.py:BlockManager.allocate_slots",
        f"{CORE}/block_manager.py:BlockManager._pop_free_block",
        f"{CORE}/block_manager.py:BlockManager.cache_full_blocks",
        f"{CORE}/block_manager.py:BlockManager.free",
    ), "2. Scheduling", "KV-cache manager, paged attention's blocks; prefix caching"),
    Assignment(2, "scheduler", "The token-budget scheduler with chunked prefill", (
        f"{CORE}/scheduler.py:Scheduler.schedule_running",
        f"{CORE}/scheduler.py:Scheduler.schedule_waiting",
        f"{CORE}/scheduler.py:Scheduler.advance",
    ), "2. Scheduling", "The scheduler; chunked prefill"),
    Assignment(3, "preemption", "Preemption by recompute", (
        f"{CORE}/scheduler.py:Scheduler.schedule",
        f"{CORE}/scheduler.py:Scheduler.allocate_or_preempt",
    ), "2. Scheduling", "The scheduler: preemption when the KV cache is full"),
    Assignment(4, "paged_attention", "Paged attention, the reference in torch", (
        "nanoinfer/attention/torch_backend.py:TorchAttentionBackend.store_kv",
        "nanoinfer/attention/torch_backend.py:TorchAttentionBackend.forward",
    ), "4. The forward pass", "The forward pass: paged attention over the block table"),
    Assignment(5, "triton_kernels", "The KV store and split-KV decode kernels in Triton", (
        "nanoinfer/kernels/store_kv.py:store_kv_kernel",
        "nanoinfer/kernels/decode_attention.py:decode_attention_kernel",
        "nanoinfer/kernels/decode_attention.py:decode_reduce_kernel",
    ), "Reading order (the GPU extras) and 4. The forward pass",
        "The forward pass: paged attention kernels"),
    Assignment(6, "sampling", "Sampling: temperature, top-k/top-p/min-p, penalties, seeds", (
        "nanoinfer/layers/sampler.py:apply_penalties",
        "nanoinfer/layers/sampler.py:apply_top_k_top_p_min_p",
        "nanoinfer/layers/sampler.py:exponential_race",
        f"{WORKER}/sampling_inputs.py:token_seed",
    ), "5. Sampling", "The forward pass: from logits to the sampled token"),
    Assignment(7, "detokenizer", "Incremental detokenization and stop strings", (
        "nanoinfer/engine/detokenizer.py:IncrementalDetokenizer.update",
        "nanoinfer/engine/detokenizer.py:IncrementalDetokenizer.visible_text",
    ), "7. Text and outputs", "The output processor: detokenization and stop conditions"),
    Assignment(8, "tensor_parallel", "Tensor-parallel linear layers", (
        "nanoinfer/layers/linear.py:ColumnParallelLinear.weight_loader",
        "nanoinfer/layers/linear.py:MergedColumnParallelLinear.weight_loader",
        "nanoinfer/layers/linear.py:QKVParallelLinear.weight_loader",
        "nanoinfer/layers/linear.py:RowParallelLinear.weight_loader",
        "nanoinfer/layers/linear.py:RowParallelLinear.forward",
    ), "9. Tensor parallelism", "Scaling up: MultiProcExecutor and tensor parallelism"),
    Assignment(9, "spec_decode", "Speculative decoding: n-gram drafts and exact verification", (
        "nanoinfer/spec_decode/ngram_proposer.py:NgramProposer.find",
        "nanoinfer/spec_decode/rejection_sampler.py:accept_drafts",
    ), "10. Speculative decoding", "Speculative decoding"),
    Assignment(10, "structured_output", "Regex to DFA to token mask", (
        "nanoinfer/structured_output/dfa.py:determinize",
        "nanoinfer/structured_output/dfa.py:DFA.walk",
        "nanoinfer/structured_output/token_index.py:TokenIndex.next_states",
        "nanoinfer/structured_output/token_index.py:TokenIndex.allowed",
        "nanoinfer/structured_output/token_index.py:TokenIndex.bitmask",
    ), "11. Structured output", "Guided decoding (FSM)"),
    Assignment(11, "kv_connector", "A KV connector: shared storage", (
        "nanoinfer/kv_transfer/shared_storage.py:SharedStorageConnector.num_matched_blocks",
        "nanoinfer/kv_transfer/shared_storage.py:SharedStorageConnector.load_kv",
        "nanoinfer/kv_transfer/shared_storage.py:SharedStorageConnector.read",
        "nanoinfer/kv_transfer/shared_storage.py:SharedStorageConnector.write_block",
    ), "14. KV connectors", "Disaggregated prefill/decode: the KV connector"),
]


def get(number: int) -> Assignment:
    for assignment in ASSIGNMENTS:
        if assignment.number == number:
            return assignment
    raise SystemExit(f"there is no assignment {number}; `python -m course list` lists them")
