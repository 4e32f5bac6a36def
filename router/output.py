"""Turning emitted token ids into what a client sees: incremental text, stop strings matched
across token boundaries (and cut from the output), EOS and max_tokens.

Detokenization is incremental (tokenizers' DecodeStream: a token's text from a few tokens of
context, an incomplete UTF-8 character held until its last byte), and stop strings are searched
only in the text not yet sent plus the new piece, so a long answer costs linear work:

    sent to the client        | unsent (held back: could start a stop string) | new piece
    "def hello"               | "(wo"                                         | "rld"
                                search region = unsent + new piece; no match ->
                                send all but the last holdback = max(len(stop)) - 1 characters
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from router.core import Delta, FinishReason, Request, TokenLogprob

_FLUSH_CONTEXT = 6  # tokens of left context to decode a held-back tail at the end (enough for any decoder)


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer, request: Request, eos_ids: set[int], max_tokens: int,
                 index: int = 0) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.max_tokens = max_tokens
        self.index = index
        # stop_token_ids end generation like EOS (and are not part of the output), ignore_eos or not
        self._natural_eos = set() if request.ignore_eos else eos_ids
        self.eos_ids = self._natural_eos | set(request.sampling.stop_token_ids)
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._skip = request.skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._pending_ids: list[int] = []  # consumed by the stream, text not out yet (incomplete bytes)
        self._unsent = ""  # decoded, not sent: may be the start of a stop string
        self._holdback = max((len(s) for s in request.stop), default=1) - 1
        self._sent_tokens = 0
        self._cut = False  # a stop string matched: the text ends at it
        self.stop_reason: str | int | None = None  # the stop string or stop token that ended it
        self.chars_scanned = 0  # stop-string search work, for the linearity test
        self._prompt_logprobs: dict[int, TokenLogprob] = {}  # position -> logprob of the prompt token there
        self._prompt_sent = False  # the first Delta went out (it carries the prompt's logprobs)
        self.cached_prompt_tokens = 0  # prompt tokens the target attaches from its prefix cache (router.prefix)
        self.prediction = (0, 0) if request.prediction else None  # its tokens verified: (accepted, rejected)

    def predicted(self, k: int, accepted: int) -> None:
        """A verification of k tokens of the predicted output, `accepted` of them accepted."""
        assert self.prediction is not None, "a request with a prediction"
        self.prediction = (self.prediction[0] + accepted, self.prediction[1] + k - accepted)

    def scored(self, start: int, logprobs: list[TokenLogprob]) -> None:
        """Logprobs of prompt tokens start, start + 1, ... (a recomputed chunk scores them again, alike)."""
        for i, lp in enumerate(logprobs):
            self._prompt_logprobs[start + i] = lp

    def scored_prompt(self) -> list[TokenLogprob]:
        """The prompt tokens' logprobs, of tokens 1 .. (the first has none): once prompt_scored."""
        return [self._prompt_logprobs[p] for p in range(1, len(self.request.prompt_ids))]

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token but the first has its logprob (what Request.prompt_logprobs asks for)."""
        return len(self._prompt_logprobs) >= len(self.request.prompt_ids) - 1

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None,
            last: bool = False) -> tuple[list[int], Delta | None]:
        """Take newly emitted tokens; return (tokens kept in the history, delta to send or None).
        last: nothing may follow them (a complete grammar): the output ends here, "stop"."""
        assert self.finish_reason is None
        kept: list[int] = []
        out: list[str] = []
        if self.max_tokens == 0:  # echo of the prompt alone: the token its last chunk emitted is not output
            self.finish_reason, token_ids = FinishReason.LENGTH, []
        for tok in token_ids:
            if tok in self.eos_ids:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = None if tok in self._natural_eos else tok  # as vLLM reports it
                if self.stop_reason is None or not self.request.include_stop_str_in_output:
                    break
            kept.append(tok)
            self.output_ids.append(tok)
            piece = self._stream.step(self.tokenizer, tok)
            if piece is None:
                self._pending_ids.append(tok)
            else:
                self._pending_ids.clear()
                if self._take(piece, out):
                    break
            if self.finish_reason is not None:  # a stop token kept in the output (include_stop_str_in_output)
                break
            if len(self.output_ids) >= self.max_tokens:
                self.finish_reason = FinishReason.LENGTH
                break
        if last and self.finish_reason is None:
            self.finish_reason = FinishReason.STOP
        if self.finish_reason is None and not kept:
            return kept, None
        if self.finish_reason is not None and not self._cut:
            self._flush(out)
        return kept, self._delta("".join(out), logprobs[: len(kept)] if logprobs is not None else None)

    def _take(self, piece: str, out: list[str]) -> bool:
        """Append decoded text; True when a stop string completed (the text is cut there)."""
        if not self.request.stop:
            out.append(piece)
            return False
        region = self._unsent + piece
        self.chars_scanned += len(region)
        hits = [(i, s) for s in self.request.stop if (i := region.find(s)) >= 0]
        if hits:
            at, self.stop_reason = min(hits, key=lambda hit: hit[0])
            out.append(region[:at + (len(self.stop_reason) if self.request.include_stop_str_in_output else 0)])
            self._unsent = ""
            self.finish_reason = FinishReason.STOP
            self._cut = True
            return True
        keep = min(self._holdback, len(region))
        out.append(region[: len(region) - keep])
        self._unsent = region[len(region) - keep:]
        return False

    def _flush(self, out: list[str]) -> None:
        """Finished without a stop string: release the held-back text and any incomplete bytes."""
        if self._pending_ids:
            n = len(self.output_ids) - len(self._pending_ids)
            context = self.output_ids[max(0, n - _FLUSH_CONTEXT):n]
            whole = self.tokenizer.decode(context + self._pending_ids, skip_special_tokens=self._skip)
            self._unsent += whole[len(self.tokenizer.decode(context, skip_special_tokens=self._skip)):]
            self._pending_ids.clear()
        out.append(self._unsent)
        self._unsent = ""

    def _delta(self, text: str, logprobs: list[TokenLogprob] | None) -> Delta | None:
        new_tokens = self.output_ids[self._sent_tokens:]
        if not text and not new_tokens and self.finish_reason is None:
            return None
        first = not self._prompt_sent and self.request.prompt_logprobs is not None
        assert not first or self.prompt_scored, "the prompt is scored by the time it yields a token"
        self._sent_tokens, self._prompt_sent = len(self.output_ids), True
        return Delta(token_ids=new_tokens, text=text, logprobs=logprobs, finish_reason=self.finish_reason,
                     completion_tokens=len(self.output_ids), prompt_tokens=len(self.request.prompt_ids),
                     index=self.index, prompt_logprobs=self.scored_prompt() if first else None,
                     cached_tokens=self.cached_prompt_tokens, stop_reason=self.stop_reason, prediction=self.prediction)

    def abort(self, reason: FinishReason, error: Exception | None = None) -> Delta:
        self.finish_reason = reason
        return Delta(token_ids=[], text="", finish_reason=reason, error=error,
                     completion_tokens=len(self.output_ids), prompt_tokens=len(self.request.prompt_ids),
                     index=self.index, cached_tokens=self.cached_prompt_tokens, prediction=self.prediction)
