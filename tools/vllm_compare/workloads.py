"""The two workloads both engines run: chats sharing a system prompt, and a Mooncake burst.

Each is a batch given up front (every request arrives at step 0, as in `vLLM.LLM.generate`),
token ids only, greedy, and a fixed number of output tokens per request (end-of-sequence is
ignored on both sides: vLLM's `ignore_eos=True`), so the two schedulers face the same sizes at
every step and any difference in their decisions is a difference of rule, not of text.

* `chat_workload`: 16 first turns, rendered with the model's own chat template (ChatML for
  SmolLM2-Instruct) over one 4-sentence system prompt, each with a question of its own. Every
  prompt starts with the same ~70 tokens: the blocks a prefix cache shares.
* `mooncake_workload`: a slice of the Mooncake conversation trace (Qin et al., FAST 2025) with its
  real size ratios and real prefix reuse, shrunk to fit a CPU: lengths divided by `shrink`, and
  each 512-token trace block id turned into a run of 512 / shrink token ids drawn from a generator
  seeded by (position, id), so prompts share exactly the token runs whose trace blocks are equal
  (`kvlab.serving.shrink` and `synthetic_prompt_ids`).
* `long_workload`: long prompts (1-4K tokens) of random token ids, where prefill dominates: either
  unrelated prompts, or (`shared_document_tokens`) one long document followed by a short question
  of each request's own, the shape of retrieval-augmented or document-chat traffic, where prefix
  caching computes the document once.
"""

from __future__ import annotations

import dataclasses

from kvlab.prefix.chats import FIRST_QUESTIONS, render_chat

__all__ = ["Workload", "SYSTEM_PROMPT", "QUESTIONS", "LONG_PROMPT_LENGTHS",
           "SHARED_DOCUMENT_TOKENS", "QUESTION_LENGTHS", "chat_workload", "mooncake_workload",
           "long_workload"]

SYSTEM_PROMPT = ("You are a patient teacher who explains things to curious students of every age. "
                 "Answer in plain, friendly words and keep every answer short and concrete. "
                 "When a question is vague, say what you assume before you answer it. "
                 "Never invent facts: say so when you do not know, and suggest where to look.")
# 16 distinct questions: kvlab's chat questions, then eight more.
QUESTIONS = FIRST_QUESTIONS + (
    "Why do cats purr?",
    "How does a bicycle stay upright?",
    "What is compound interest?",
    "Why do leaves change colour in autumn?",
    "How does a refrigerator keep food cold?",
    "What causes the tides?",
    "How do vaccines work?",
    "What is a prime number?",
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A batch of requests: prompts as token ids and the output tokens each generates.

    Attributes:
        name: 'chats', 'mooncake', 'long' or 'long-shared'.
        prompts: token ids per request, in arrival (admission) order.
        max_tokens: output tokens per request (vLLM's `SamplingParams.max_tokens`).
        parameters: what made it (for printing beside the figures).
    """

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    parameters: dict

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"workload {self.name!r}: {len(self.prompts)} prompts and "
                             f"{len(self.max_tokens)} max_tokens (need the same number, >= 1)")

    @property
    def longest(self) -> int:
        """Tokens of the longest request at its end (prompt + max_tokens)."""
        return max(len(p) + n for p, n in zip(self.prompts, self.max_tokens))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def chat_workload(tokenizer, chat_template=None, num_chats: int = 16,
                  max_tokens: int = 48) -> Workload:
    """`num_chats` first turns over `SYSTEM_PROMPT`, rendered with `chat_template`.

    Args:
        tokenizer: a `tokenizers.Tokenizer`.
        chat_template: the model's `ChatTemplate` (None: kvlab's plain transcript, tiny model).
        num_chats: 1 .. len(QUESTIONS).
        max_tokens: output tokens per chat.

    Raises:
        ValueError: num_chats out of range, max_tokens < 1.
    """
    if not 1 <= num_chats <= len(QUESTIONS):
        raise ValueError(f"num_chats must be 1 .. {len(QUESTIONS)} (one question each), "
                         f"got {num_chats}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    prompts = []
    for question in QUESTIONS[:num_chats]:
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]
        prompts.append(tokenizer.encode(render_chat(messages, chat_template)).ids)
    return Workload("chats", prompts, [max_tokens] * num_chats,
                    {"num_chats": num_chats, "max_tokens": max_tokens,
                     "chat_template": chat_template is not None})


def mooncake_workload(vocab_size: int, num_requests: int = 24, shrink: int = 16,
                      max_prompt_tokens: int = 512, max_tokens: int = 32, start: int = 0,
                      seed: int = 0) -> Workload:
    """The first `num_requests` requests of the Mooncake conversation trace from line `start`
    whose shrunk prompt fits `max_prompt_tokens`, shrunk by `shrink`, as token ids.

    Args:
        vocab_size: token ids are drawn from [0, vocab_size).
        num_requests: requests kept (>= 1).
        shrink: lengths divided by it; it must divide 512 (one trace block becomes 512 / shrink
            tokens).
        max_prompt_tokens: longer shrunk prompts are skipped (a CPU-sized max_model_len).
        max_tokens: output tokens per request at most (the trace's, shrunk, capped here).
        start: first trace line read.
        seed: the token-id generator's seed.

    Raises:
        ValueError: bad sizes, or the trace has fewer such requests.
    """
    from kvlab.serving import Request, shrink as shrink_requests, synthetic_prompt_ids
    from kvlab.traces.mooncake import TRACE_BLOCK_SIZE, load_mooncake_trace

    for name, value in (("num_requests", num_requests), ("shrink", shrink),
                        ("max_prompt_tokens", max_prompt_tokens), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if TRACE_BLOCK_SIZE % shrink:
        raise ValueError(f"shrink must divide {TRACE_BLOCK_SIZE} (the trace's block), got {shrink}")
    trace = load_mooncake_trace("conversation")
    rows = [Request(i, 0.0, r.prompt_len, max(1, r.output_len),
                    trace_block_ids=r.trace_block_ids, trace_block_size=TRACE_BLOCK_SIZE)
            for i, r in enumerate(trace.requests[start:])]
    kept = [r for r in shrink_requests(rows, shrink) if r.prompt_len <= max_prompt_tokens]
    if len(kept) < num_requests:
        raise ValueError(f"the trace has {len(kept)} requests from line {start} with a shrunk "
                         f"prompt <= {max_prompt_tokens} tokens; asked for {num_requests}")
    kept = kept[:num_requests]
    prompts = [synthetic_prompt_ids(r, vocab_size, seed) for r in kept]
    return Workload("mooncake", prompts, [min(r.max_output_tokens, max_tokens) for r in kept],
                    {"trace": "conversation", "start": start, "num_requests": num_requests,
                     "shrink": shrink, "max_prompt_tokens": max_prompt_tokens,
                     "max_tokens": max_tokens, "seed": seed})


# Unrelated long prompts: lengths spread over 1-4K tokens (one of 4,000 as in the profile that
# opened issue 34, beside 1,500 and 900).
LONG_PROMPT_LENGTHS = (4000, 3000, 2200, 1500, 1200, 900)
# 'long-shared': one document, then a question of its own per request.
SHARED_DOCUMENT_TOKENS = 3000
QUESTION_LENGTHS = (120, 60, 200, 90, 150, 40, 180, 75)


def long_workload(vocab_size: int, shared_document_tokens: int = 0,
                  lengths: tuple[int, ...] = LONG_PROMPT_LENGTHS, max_tokens: int = 16,
                  seed: int = 0) -> Workload:
    """Long prompts of token ids drawn uniformly from [0, vocab_size) with `seed`.

    Without a shared document ('long'), request i's prompt is `lengths[i]` unrelated ids. With
    `shared_document_tokens` > 0 ('long-shared'), every prompt is the same document of that many
    ids followed by a question of its own of `lengths[i]` ids (give short lengths, e.g. 40-200).

    Raises:
        ValueError: no lengths, a length or max_tokens < 1, shared_document_tokens < 0.
    """
    import random

    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths!r}")
    if max_tokens < 1 or shared_document_tokens < 0:
        raise ValueError(f"max_tokens must be >= 1 and shared_document_tokens >= 0, got "
                         f"{max_tokens} and {shared_document_tokens}")
    draw = random.Random(seed)
    document = [draw.randrange(vocab_size) for _ in range(shared_document_tokens)]
    prompts = [document + [draw.randrange(vocab_size) for _ in range(n)] for n in lengths]
    name = "long-shared" if shared_document_tokens else "long"
    return Workload(name, prompts, [max_tokens] * len(prompts),
                    {"shared_document_tokens": shared_document_tokens, "lengths": list(lengths),
                     "max_tokens": max_tokens, "seed": seed})
