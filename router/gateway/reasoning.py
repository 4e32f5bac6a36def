"""A reasoning model's thinking apart from its answer (vLLM's --reasoning-parser), as chat's
message.reasoning_content (DeepSeek's and vLLM's name for it).

    deepseek_r1   the output starts inside a think block (the chat template opened <think>):
                  everything before </think> is reasoning, the rest the answer; no </think> yet
                  (cut short): all reasoning
    qwen3         a think block only where the output opens one with <think> (with enable_thinking:
                  false Qwen3's template writes an empty block into the prompt, and the answer is
                  all content)

Streamed, the reasoning goes out as delta.reasoning_content until </think>, then the answer as
delta.content (a tail that could begin a marker waits for the next tokens). A request whose output
is constrained (response_format, a named or required tool call) thinks first too: its grammar holds
from the token after </think> (router.structured.SeqGrammar, where </think> is one token, as in
Qwen3's and DeepSeek-R1's vocabularies); told not to think (chat_template_kwargs enable_thinking:
false), or without such a token, it holds from the first token and nothing is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import REASONING_PARSERS, THINK_CLOSE, THINK_OPEN

OPEN, CLOSE = THINK_OPEN, THINK_CLOSE


def without_partial(text: str, marker: str) -> str:
    """text less a tail that could be the start of marker (streamed text waits for the next tokens)."""
    held = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
    return text[:len(text) - held]


@dataclass(frozen=True)
class Reasoning:
    starts_inside: bool  # deepseek_r1: the output begins in a think block its prompt opened
    end_id: int | None = None  # </think> as one token, where the vocabulary has it (to count reasoning tokens)
    start_id: int | None = None  # <think> likewise

    @classmethod
    def named(cls, parser: str, end_id: int | None = None, start_id: int | None = None) -> Reasoning:
        assert parser in REASONING_PARSERS, parser
        return cls(parser == "deepseek_r1", end_id, start_id)

    def tokens(self, ids: list[int]) -> int:
        """How many of an answer's tokens are its thinking, markers included (0 where the markers are
        not single tokens): OpenAI's usage.completion_tokens_details.reasoning_tokens."""
        if self.end_id is None or not ids:
            return 0
        if not self.starts_inside and (self.start_id is None or ids[0] != self.start_id):
            return 0
        return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)

    def split(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(the reasoning that may be shown, the answer so far: None while the model is still thinking,
        or might be). Not finished, a tail that could begin a marker is held back."""
        opened = text.startswith(OPEN)
        if not opened and not finished and OPEN.startswith(text):
            return "", None  # "", "<", "<th": a block may be opening
        if not (opened or self.starts_inside):
            return "", text
        thought = text[len(OPEN):] if opened else text
        reasoning, closed, answer = thought.partition(CLOSE)
        if closed:
            return reasoning, answer
        return (reasoning if finished else without_partial(reasoning, CLOSE)), None
