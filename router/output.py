"""Turning emitted token ids into what a client sees: incremental text, stop strings matched
across token boundaries (and cut from the output), EOS and max_tokens."""

from __future__ import annotations

from tokenizers import Tokenizer

from router.core import Delta, FinishReason, GenerationRequest, TokenLogprob


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer, request: GenerationRequest, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.eos_ids = set() if request.ignore_eos else eos_ids
        self.output_ids: list[int] = []
        self.text = ""
        self._sent_chars = 0
        self._sent_tokens = 0
        self._holdback = max((len(s) for s in request.stop), default=1) - 1
        self.finish_reason: FinishReason | None = None

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> tuple[list[int], Delta | None]:
        """Take newly emitted tokens; return (tokens kept in the history, delta to send or None)."""
        assert self.finish_reason is None
        kept: list[int] = []
        cut = False  # a stop string matched: self.text is already decoded and cut
        for tok in token_ids:
            if tok in self.eos_ids:
                self.finish_reason = FinishReason.STOP
                break
            kept.append(tok)
            self.output_ids.append(tok)
            if self._check_stop_strings():
                cut = True
                break
            if len(self.output_ids) >= self.request.max_tokens:
                self.finish_reason = FinishReason.LENGTH
                break
        if not kept and self.finish_reason is None:
            return kept, None
        if not cut:  # also on EOS / max_tokens: the text of this step's tokens must go out
            self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return kept, self._delta(logprobs[: len(kept)] if logprobs is not None else None)

    def _check_stop_strings(self) -> bool:
        if not self.request.stop:
            return False
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        # only the tail can hold a new match: earlier text was checked on earlier tokens
        search_from = max(0, len(self.text) - self._holdback - 1)
        hits = [i for i in (text.find(s, search_from) for s in self.request.stop) if i >= 0]
        self.text = text
        if hits:
            self.text = text[: min(hits)]
            self.finish_reason = FinishReason.STOP
            return True
        return False

    def _delta(self, logprobs: list[TokenLogprob] | None) -> Delta | None:
        finished = self.finish_reason is not None
        end = len(self.text)
        if not finished:
            while end > self._sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for its next byte
            end -= self._holdback  # could be the start of a stop string (whose end may be that character)
        end = max(end, self._sent_chars)
        new_tokens = self.output_ids[self._sent_tokens:]
        if end == self._sent_chars and not finished and not new_tokens:
            return None
        delta = Delta(
            token_ids=new_tokens, text=self.text[self._sent_chars:end], logprobs=logprobs,
            finish_reason=self.finish_reason, completion_tokens=len(self.output_ids),
            prompt_tokens=len(self.request.prompt_ids),
        )
        self._sent_chars, self._sent_tokens = end, len(self.output_ids)
        return delta

    def abort(self, reason: FinishReason, error: Exception | None = None) -> Delta:
        self.finish_reason = reason
        return Delta(token_ids=[], text="", finish_reason=reason, error=error,
                     completion_tokens=len(self.output_ids), prompt_tokens=len(self.request.prompt_ids))
