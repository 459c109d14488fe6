"""The demonstration: a workload on the embedded SmolLM2 that shows every mechanism of the base
engine within a minute on a CPU, recorded, then shown (`python -m view --demo`).

- a system prompt with few-shot examples that ten questions share: the first request computes
  its blocks, the others find them in the prefix cache (`BlockManager.get_computed_blocks`), and
  while they run the blocks are shared (a reference count of several);
- a KV cache of 32 blocks (512 tokens) for all of it: the running requests outgrow it, and the
  newest is preempted (`Scheduler.allocate_or_preempt`) and computed again later;
- a long document to summarise, of more tokens than a step's budget (160): its prefill is
  chunked over several steps, beside the others' decodes.

Greedy decoding, and 48 tokens each, so that the run is the same every time.
"""
SYSTEM = ("You are a patient teacher. Answer in one or two short sentences, plainly.\n"
          "Q: What is a noun? A: A word that names a person, place or thing.\n"
          "Q: What is a verb? A: A word for an action, such as run or think.\n"
          "Q: What is an adjective? A: A word that describes a noun, such as red.\n")
QUESTIONS = ["What is an adverb?", "What is a pronoun?", "What is a sentence?",
             "What is a paragraph?", "What is a comma for?", "What is a question mark for?",
             "What is a synonym?", "What is an antonym?", "What is a prefix?", "What is a suffix?"]
DOCUMENT = ("An inference engine keeps the keys and values of every token it has seen in a paged "
            "cache, cut into blocks of sixteen tokens. ") * 12 + "Summarise this in a line."


def record(path: str) -> None:
    """Run the demonstration's workload, its event log written to `path`."""
    from nanoinfer import LLM, SamplingParams
    llm = LLM(event_log=path, num_kvcache_blocks=32, max_num_batched_tokens=160,
              max_num_seqs=8, max_model_len=512)
    try:
        prompts = [f"{SYSTEM}Q: {q} A:" for q in QUESTIONS] + [DOCUMENT]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
