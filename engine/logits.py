"""Logits processors, applied identically on the target (to p) and the draft (to q) before temperature,
top-k and top-p, so that strict rejection sampling stays exact for the processed distribution p'.

Order (vLLM's): the grammar mask, allowed_token_ids, bad_words, logit_bias, min_tokens, then the
repetition, frequency and presence penalties. The rows of one sequence decide consecutive positions:
row i sees the history plus the tokens the earlier rows decided (the drafts before it), so the
penalties and bad words of a verification position count the drafts in front of it, exactly as if
they had been generated one at a time.

    repetition (HF RepetitionPenaltyLogitsProcessor)  seen in prompt or output: x / r if x > 0 else x * r
    frequency, presence (OpenAI)                      x -= frequency * count + presence * [count > 0],
                                                      counting output tokens only
    min_tokens                                        held-back ids (EOS, stop_token_ids) get -inf while
                                                      fewer than min_tokens tokens were generated
    allowed_token_ids (vLLM)                          every other id gets -inf
    bad_words (vLLM)                                  a sequence's last token gets -inf where the output
                                                      so far ends with its other tokens (the prompt does
                                                      not count; a one-token sequence: always)
    thinking_token_budget (vLLM)                      applied last: after that many output tokens of
                                                      thinking (from the think-start token, or the output's
                                                      start) without the think-end token, the think-end
                                                      token is the only one left
A sequence without any of these costs nothing here: its logits are not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling import SamplingParams
from tandem.v1 import common_pb2

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Processors:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    held_back: tuple[int, ...] = ()  # the ids min_tokens keeps out
    prompt_len: int = 0  # positions >= prompt_len are output
    allowed: tuple[int, ...] = ()  # () = every id
    bad_words: tuple[tuple[int, ...], ...] = ()
    think_budget: int = -1  # -1: none
    think_end: int = -1
    think_start: int = -1  # -1: the output starts inside thinking

    @property
    def penalized(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether a row's processing reads the tokens before it (penalties, bad words of two tokens or
        more, a thinking budget)."""
        return self.penalized or any(len(w) > 1 for w in self.bad_words) or self.think_budget >= 0

    @staticmethod
    def from_proto(params: common_pb2.SamplingParams, prompt_len: int, vocab: int) -> Processors | None:
        """None when the request uses no processor. Raises common.sampling.InvalidField on bad values
        (token ids outside [0, vocab) among them)."""
        p = SamplingParams(temperature=0.0).updated(**SamplingParams.given_in(params))
        p.check()
        p.check_vocab(vocab)
        if not p.processed:
            return None
        end, start = p.think_tokens or (-1, None)
        return Processors(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens,
                          p.stop_token_ids, prompt_len, p.allowed_token_ids, p.bad_words,
                          -1 if p.thinking_token_budget is None else p.thinking_token_budget, end,
                          -1 if start is None else start)


@dataclass(frozen=True)
class Context:
    """What one sequence's consecutive rows see: row i decides the token after history + extra[:i]."""

    processors: Processors | None
    history: Sequence[int] = ()  # tokens before the first row's position; needed by penalties only
    extra: Sequence[int] = ()  # tokens decided by the earlier rows (the drafts)
    masks: Sequence[bytes] = ()  # grammar: allowed tokens per row (packed bits, little-endian); empty: none
    first_pos: int = 0  # absolute position of the first row's token (min_tokens counts from it)


def unpack_masks(masks: Sequence[bytes], vocab: int) -> np.ndarray:
    """[rows, vocab] bool from packed little-endian bitmasks (ids past a mask's end are not allowed)."""
    width = -(-vocab // 8)
    buf = np.zeros((len(masks), width), dtype=np.uint8)
    for i, m in enumerate(masks):
        n = min(len(m), width)
        buf[i, :n] = np.frombuffer(m, dtype=np.uint8, count=n)
    return np.unpackbits(buf, axis=1, bitorder="little")[:, :vocab].astype(bool)


def apply(logits: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Processed copy of one sequence's rows [R, V] (the input is returned untouched when nothing applies)."""
    p = ctx.processors
    if p is None and not ctx.masks:
        return logits
    rows, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()
    if ctx.masks:
        assert len(ctx.masks) == rows, "one grammar mask per row"
        allowed = torch.from_numpy(unpack_masks(ctx.masks, vocab)).to(dev)
        out.masked_fill_(~allowed, NEG_INF)
    if p is None:
        return out
    if p.allowed:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[torch.tensor(p.allowed, device=dev)] = True
        out.masked_fill_(~keep, NEG_INF)
    if p.bad_words:
        _ban_words(out, p, ctx)
    if p.bias:
        ids = torch.tensor([t for t, _ in p.bias], device=dev)
        out[:, ids] += torch.tensor([b for _, b in p.bias], device=dev)
    if p.min_tokens and p.held_back:
        generated = torch.arange(rows, device=dev) + (ctx.first_pos - p.prompt_len)
        short = (generated < p.min_tokens).nonzero().squeeze(-1)
        if short.numel():
            held = torch.tensor(p.held_back, device=dev)
            out[short[:, None], held[None, :]] = NEG_INF
    if p.penalized:
        out = _penalize(out, p, ctx)
    if p.think_budget >= 0:
        _cap_thinking(out, p, ctx)
    return out


def _cap_thinking(out: torch.Tensor, p: Processors, ctx: Context) -> None:
    """Rows past the budget inside thinking get only the think-end token.

        output  <think> t1 t2 t3 | d1 d2       budget 3, start <think>: rows 0.. (after t3) end it
    """
    rows = out.shape[0]
    output, done = _output(p, ctx, rows)
    ended = _find(output, p.think_end)
    begun = 0 if p.think_start < 0 else _find(output, p.think_start) + 1
    for i in range(rows):
        seen = done + i  # output tokens before row i's
        if ended >= seen and begun <= seen and seen - begun >= p.think_budget:
            out[i] = NEG_INF
            out[i, p.think_end] = 0.0


def _output(p: Processors, ctx: Context, rows: int) -> tuple[list[int], int]:
    """The output tokens the last of `rows` rows sees (history's, then the drafts), and how many come
    before row 0."""
    assert len(ctx.history) == ctx.first_pos, "reads the whole history: Processors.needs_history"
    return list(ctx.history[p.prompt_len:]) + list(ctx.extra[:rows - 1]), ctx.first_pos - p.prompt_len


def _find(tokens: list[int], token: int) -> int:
    """Index of token's first occurrence; len(tokens) + 1 when absent (past every row)."""
    try:
        return tokens.index(token)
    except ValueError:
        return len(tokens) + 1


def _ban_words(out: torch.Tensor, p: Processors, ctx: Context) -> None:
    """Row i's output so far is history[prompt_len:] + extra[:i]: a word's last token is out where it
    would complete the word.

        output ... a b | d1 d2          word (b, d1, x): row 1 (after d1) bans x
    """
    rows = out.shape[0]
    singles = [w[0] for w in p.bad_words if len(w) == 1]
    if singles:
        out[:, singles] = NEG_INF
    if len(singles) == len(p.bad_words):
        return
    output, done = _output(p, ctx, rows)
    for word in p.bad_words:
        *head, last = word
        n = len(head)
        for i in range(rows):
            end = done + i
            if n and end >= n and output[end - n:end] == head:
                out[i, last] = NEG_INF


def _penalize(out: torch.Tensor, p: Processors, ctx: Context) -> torch.Tensor:
    rows, vocab = out.shape
    dev = out.device
    history = torch.tensor(list(ctx.history), dtype=torch.long, device=dev)
    counts = torch.bincount(history[p.prompt_len:], minlength=vocab).float()[None].repeat(rows, 1)
    seen = torch.bincount(history, minlength=vocab)[None].repeat(rows, 1) > 0
    if rows > 1:  # row i also sees the tokens the rows before it decided
        earlier = torch.tensor(list(ctx.extra[:rows - 1]), dtype=torch.long, device=dev)
        cumulative = torch.nn.functional.one_hot(earlier, vocab).float().cumsum(0)
        counts[1:] += cumulative
        seen[1:] |= cumulative > 0
    if p.repetition != 1.0:
        out = torch.where(seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out)
    return out - p.frequency * counts - p.presence * (counts > 0).float()


class TokenHistory:
    """Token ids of each sequence's cached positions, kept beside its KV by the services whose requests
    use penalties (which need the whole history, not just the step's tokens). Position-addressed like
    the KV: an entry at start_pos trims everything past it, so rejected drafts never linger."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}

    def covers(self, seq_id: int, start_pos: int) -> bool:
        return len(self._tokens.get(seq_id, ())) >= start_pos

    def put(self, seq_id: int, start_pos: int, tokens: Sequence[int]) -> None:
        held = self._tokens.setdefault(seq_id, [])
        assert len(held) >= start_pos, "covers() first"
        del held[start_pos:]
        held.extend(tokens)

    def get(self, seq_id: int, end: int) -> list[int]:
        return self._tokens.get(seq_id, [])[:end]

    def fork(self, parent: int, child: int, length: int) -> None:
        self._tokens[child] = self._tokens.get(parent, [])[:length]

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._tokens.pop(seq_id, None)
