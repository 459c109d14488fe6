"""The request streams of the prefix-caching study (docs/prefix_study.py), made from a seed.

A stream is a list of requests in arrival order; a request is its prompt's token ids and the
tokens it generates (`Request.output`). Token ids are drawn uniformly from [3, VOCAB_SIZE), so two
pieces of text share a prefix only where a stream makes them share one. What each stream models:

- `multi_turn`: chats. Every turn sends the whole conversation so far (a short system prompt, then
  each user message and reply) plus a new user message; the conversations' turns are interleaved
  at random, each in its own order.
- `system_prompt`: one application per long system prompt with few-shot examples (several
  applications, their requests interleaved), each request that prompt plus a short question.
- `tree_of_thought`: many continuations of one problem statement. A request takes an earlier
  request's tokens (or the statement), cuts them at a random token past the statement, adds a
  few tokens and generates a new thought from there, so branches start at arbitrary positions.
- `agent_loop`: agents with one shared tool description. Each step sends the agent's context,
  generates a short tool call, and the tool's small result is appended for the next step.
- `random_prompts`: prompts of random tokens, no sharing at all (what it costs to look up a
  cache that never hits).

`reply(prompt, n)` gives the `n` tokens a request generates: random tokens for the study; the
engine's own greedy tokens for the engine check, so that a later turn resends what the model
really said. The sizes are the study's: 192 to 240 requests a stream (`quick=True`, for tests:
18 to 40).
"""
import random
from collections.abc import Callable
from dataclasses import dataclass

VOCAB_SIZE = 32000
Reply = Callable[[list[int], int], list[int]]


@dataclass(slots=True)
class Request:
    prompt: list[int]
    output: list[int]
    # The earlier request (its index) whose output this prompt carries: in a live session it can
    # only be sent once that one has finished. None: it can be sent at any time.
    after: int | None = None

    @property
    def computed(self) -> list[int]:
        """The tokens whose keys and values the engine computes: the prompt and every output
        token but the last (sampled, never fed back)."""
        return self.prompt + self.output[:-1]


def tokens(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))]


def interleaved(rng: random.Random, sessions: int, steps: int) -> list[int]:
    """`steps` turns of each of `sessions` sessions in a random order (each session's own turns
    in order)."""
    order = [s for s in range(sessions) for _ in range(steps)]
    rng.shuffle(order)
    return order


def multi_turn(rng: random.Random, reply: Reply, conversations: int = 24, turns: int = 8,
               reply_len: tuple[int, int] = (50, 300)) -> list[Request]:
    system = tokens(rng, 40, 40)
    history = [list(system) for _ in range(conversations)]
    last: list[int | None] = [None] * conversations
    stream = []
    for c in interleaved(rng, conversations, turns):
        prompt = history[c] + tokens(rng, 20, 200)
        stream.append(Request(prompt, reply(prompt, rng.randint(*reply_len)), last[c]))
        history[c] = prompt + stream[-1].output
        last[c] = len(stream) - 1
    return stream


def system_prompt(rng: random.Random, reply: Reply, apps: int = 4, requests: int = 240,
                  reply_len: tuple[int, int] = (20, 200), examples: tuple[int, int] = (4, 8)
                  ) -> list[Request]:
    prefixes = []
    for _ in range(apps):
        prefix = tokens(rng, 300, 600)
        for _ in range(rng.randint(*examples)):   # few-shot examples: a question, its answer
            prefix += tokens(rng, 80, 200)
        prefixes.append(prefix)
    stream = []
    for _ in range(requests):
        prompt = prefixes[rng.randrange(apps)] + tokens(rng, 20, 150)
        stream.append(Request(prompt, reply(prompt, rng.randint(*reply_len))))
    return stream


def tree_of_thought(rng: random.Random, reply: Reply, requests: int = 200,
                    reply_len: tuple[int, int] = (30, 150)) -> list[Request]:
    problem = tokens(rng, 400, 800)
    paths = [problem]   # the statement, then each request's prompt and output
    stream = []
    for _ in range(requests):
        parent = rng.randrange(len(paths))
        cut = rng.randint(len(problem), len(paths[parent]))
        prompt = paths[parent][:cut] + tokens(rng, 1, 30)
        after = parent - 1 if parent else None
        stream.append(Request(prompt, reply(prompt, rng.randint(*reply_len)), after))
        paths.append(prompt + stream[-1].output)
    return stream


def agent_loop(rng: random.Random, reply: Reply, agents: int = 12, steps: int = 16,
               call_len: tuple[int, int] = (15, 60)) -> list[Request]:
    tools = tokens(rng, 1000, 1500)
    context = [tools + tokens(rng, 50, 200) for _ in range(agents)]
    last: list[int | None] = [None] * agents
    stream = []
    for a in interleaved(rng, agents, steps):
        stream.append(Request(context[a], reply(context[a], rng.randint(*call_len)), last[a]))
        context[a] = context[a] + stream[-1].output + tokens(rng, 10, 120)
        last[a] = len(stream) - 1
    return stream


def random_prompts(rng: random.Random, reply: Reply, requests: int = 200,
                   reply_len: tuple[int, int] = (20, 200)) -> list[Request]:
    stream = []
    for _ in range(requests):
        prompt = tokens(rng, 100, 1000)
        stream.append(Request(prompt, reply(prompt, rng.randint(*reply_len))))
    return stream


STREAMS = {"multi-turn chat": multi_turn, "system prompt": system_prompt,
           "tree of thought": tree_of_thought, "agent loop": agent_loop,
           "random prompts": random_prompts}
QUICK_SIZES = {"multi-turn chat": dict(conversations=6, turns=4),
               "system prompt": dict(requests=40), "tree of thought": dict(requests=32),
               "agent loop": dict(agents=3, steps=6), "random prompts": dict(requests=32)}


def make_streams(seed: int = 0, quick: bool = False) -> dict[str, list[Request]]:
    """Every stream, each from its own `random.Random(seed)`, replies drawn from it too."""
    streams = {}
    for name, make in STREAMS.items():
        rng = random.Random(seed)
        sizes = QUICK_SIZES[name] if quick else {}
        streams[name] = make(rng, random_reply(rng), **sizes)
    return streams


def random_reply(rng: random.Random) -> Reply:
    """Replies of random tokens, drawn from the stream's own generator."""
    return lambda prompt, n: [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]
