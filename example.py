"""Chat with a small model: `python example.py` (the embedded SmolLM2-135M-Instruct) or
`python example.py --model /path/to/hf-folder`."""
import argparse
import time

from nanoinfer import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    start = time.perf_counter()
    print("loading the model ...", flush=True)
    llm = LLM(args.model, max_model_len=2048)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Give me three tips for writing clear code.",
        "Explain in two sentences why the sky is blue.",
    ]
    print(f"model loaded in {time.perf_counter() - start:.0f} s; answering {len(questions)} "
          f"questions (up to {args.max_tokens} tokens each; in a terminal, a bar counts them) ...",
          flush=True)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    # greedy: a 135M model answers best without sampling noise (and its tokens equal transformers')
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for question, output in zip(questions, llm.chat(conversations, params)):
        print(f"\n>>> {question}\n{output.outputs[0].text.strip()}")


if __name__ == "__main__":
    main()
