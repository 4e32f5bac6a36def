"""Prompt lookup (n-gram) proposals: when no draft proposal continues a sequence, the router looks
for the sequence's last few tokens earlier in its own history and proposes what followed them there
(Saxena's prompt lookup decoding; vLLM's "ngram" speculation). Code, quotes, lists and the loops a
small model falls into repeat themselves; a guess that is wrong costs only the verification slots.

    history:  ... def area(r): return 3.14 * r * r \\n def perimeter(r): return 3.14 *
                                 ^^^^^^^^^^^^^^^^^                      ^^^^^^^^^^^^^^^  (suffix, n = 4)
    proposal: the k tokens after the earlier occurrence: "r * r \\n"

The index of n-grams grows with the history (a few dict entries per token), so a lookup costs the
same however long the sequence is. Proposals are point guesses: for sampled requests their q is 1
on the guessed token, and strict rejection sampling stays exact (accept with probability p(x)).

A request may also give the output it expects (OpenAI's Predicted Outputs, `prediction`: the file an
edit rewrites, say). While the output so far is the prediction's start, the proposal is what comes
next in it; once they part, the suffix is looked for in the prediction (its next occurrence after
the last one followed) before the history, so the output falls back in step where the two meet again:

    prediction:  a b c d e f g h            output so far: a b X Y d e   (an edit: c -> X Y)
                                            suffix "d e" found in the prediction: propose f g h
"""

from __future__ import annotations

from collections.abc import Sequence as Seq


class PromptLookup:
    def __init__(self, n_min: int = 2, n_max: int = 4, prediction: Seq[int] = (), start: int = 0,
                 history: bool = True) -> None:
        """prediction: the output the request expects, whose first token would follow history[:start].
        history False: the prediction alone is looked in (the router's --no-prompt-lookup)."""
        assert 1 <= n_min <= n_max
        self.n_min, self.n_max, self.history = n_min, n_max, history
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence (indexed so far)
        self._indexed = 0  # n-grams ending at positions <= this are in the index
        self._last_offer: tuple[int, int, list[int]] = (-1, 0, [])  # (history length, k, proposal)
        self.prediction, self.start = list(prediction), start
        self._predicted: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends of its occurrences, ascending
        for stop in range(n_min, len(self.prediction) + 1):
            for n in range(n_min, min(n_max, stop) + 1):
                self._predicted.setdefault(tuple(self.prediction[stop - n:stop]), []).append(stop)
        self._on_prefix = 0  # output tokens known to equal the prediction's start
        self._followed = 0  # where in the prediction the last proposal from it continued
        self.from_prediction = False  # the latest offer came from the prediction

    def anew(self) -> PromptLookup:
        """A fresh lookup made as this one was (its prediction, whether it looks in the history), with
        an index of its own; the prediction's n-grams are shared (they never change)."""
        fresh = PromptLookup(self.n_min, self.n_max, start=self.start, history=self.history)
        fresh.prediction, fresh._predicted = self.prediction, self._predicted
        return fresh

    def propose(self, history: Seq[int], k: int, end: int | None = None) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the history's suffix (the history:
        history[:end], all of it by default; `end` never decreases between calls). A history only grows, so
        its length names it: the router asks up to four times a step (its offer, the fill, the wait and the
        chaining decisions), and the answer is kept for the same length and k."""
        end = len(history) if end is None else end
        if self._last_offer[:2] == (end, k):
            return list(self._last_offer[2])
        offer, matched, followed = self._predicted_offer(history, k, end) if self.prediction else ([], 0, 0)
        if self.history:
            self._index(history, end - 1)  # everything but the suffix itself
        at = self._earlier(history, end, max(self.n_min, matched + 1)) if self.history else None
        if at is not None:  # a longer match than the prediction's wins
            offer, matched = list(history[at:min(at + k, end)]), 0
        if matched:
            self._followed = followed
        self.from_prediction = bool(matched and offer)
        self._last_offer = (end, k, offer)
        return list(offer)

    def peek(self, history: Seq[int], known: int, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the suffix of `history`, of which only
        the first `known` tokens are the sequence's (the rest: an outcome its running step may emit).
        What the guess adds is never indexed, and the offer kept for propose() is left alone, so the
        router may ask about outcomes that do not happen. Its own n-grams missing from the index, a
        guess finds what propose() would a step later, or an earlier occurrence of it. A request with
        a prediction is not peeked (its offers follow the output the prediction met)."""
        if not self.history or self.prediction:
            return []
        assert 0 < known <= len(history)
        self._index(history, known - 1)
        at = self._earlier(history, len(history), self.n_min)
        return [] if at is None else list(history[at:at + k])

    def _earlier(self, history: Seq[int], end: int, shortest: int) -> int | None:
        """Where the longest suffix of history[:end] (n_max tokens down to `shortest`) was last followed by
        a token in the index: that token's position; None where no suffix was."""
        for n in range(min(self.n_max, end - 1), shortest - 1, -1):
            at = self._last.get(tuple(history[end - n:end]))
            if at is not None:
                return at
        return None

    def _predicted_offer(self, history: Seq[int], k: int, end: int) -> tuple[list[int], int, int]:
        """The prediction's continuation, the length of the suffix it matched (0: none; past n_max on the
        prediction's start, which no history match beats) and where it continues the prediction: after
        its start while the output is that start, else after the next occurrence (from the last one
        followed) of the history's longest suffix found in it."""
        done = end - self.start  # output tokens so far
        pred = self.prediction
        while self._on_prefix < min(done, len(pred)) and history[self.start + self._on_prefix] == pred[self._on_prefix]:
            self._on_prefix += 1
        if self._on_prefix == done >= 0 and done < len(pred):
            return pred[done:done + k], self.n_max + 1, done
        for n in range(min(self.n_max, done), self.n_min - 1, -1):
            ends = self._predicted.get(tuple(history[end - n:end]))
            if ends:
                at = next((e for e in ends if e >= self._followed), ends[0])
                if at < len(pred):
                    return pred[at:at + k], n, at
        return [], 0, 0

    def _index(self, history: Seq[int], upto: int) -> None:
        for stop in range(max(self._indexed, self.n_min), upto + 1):
            for n in range(self.n_min, min(self.n_max, stop) + 1):
                self._last[tuple(history[stop - n:stop])] = stop
        self._indexed = max(self._indexed, upto + 1)


class LookupShadow:
    """Prompt lookup alone, replayed over a sequence's text as it grows: how many steps it would have
    taken to emit that text, each step verifying its k guesses and emitting the matched ones and the
    target's next token. The draft regime counts a step's progress in these steps (router.regime): the
    same unit whichever proposer made the text, so a window of repeated code and one of fresh prose
    compare what a step costs, not what the text yields.

        text      ... h | a b c d e f g          the sequence's tokens, the replay at h
        guesses         a b x y                  lookup's k = 4 after h: a b match, x fails
        one step        a b c                    resolved once the text shows c; the next starts at d

    Exact for greedy requests (lookup alone would have made the same text); for sampled ones a guess
    counts as accepted where it equals the target's token. Estimating lookup's steps from its one
    proposal at the start of each drafting step instead (the rest of the step's tokens at that
    proposal's yield) read 1.15x the replayed count on the demo pair's bench prompts (0.89-1.41x per
    prompt): the text right after a history with no match is often a repeat that lookup finds a token
    later, so drafting was credited with steps lookup alone would not have needed."""

    def __init__(self, k: int, start: int, lookup: PromptLookup | None = None) -> None:
        """lookup: a fresh one made as the sequence's own was (PromptLookup.anew), with its own index:
        the sequence's has n-grams past `pos`."""
        assert k >= 1 and start >= 0
        self.k = k
        self.pos = start  # the replay has emitted the text up to here
        self._lookup = lookup or PromptLookup()

    def restart(self, at: int) -> None:
        """Replay from `at` on, as if lookup alone had just emitted the text up to there (its index kept)."""
        self.pos = at

    def advance(self, text: Seq[int], finished: bool) -> int:
        """The steps of lookup alone that the text's growth since the last call resolved: a step is
        resolved once the text holds the token after its matched guesses (the one that failed them, or
        the target's own after all k), or the text is finished (its last step emits what is left)."""
        steps, end = 0, len(text)
        while self.pos < end:
            guesses = self._lookup.propose(text, self.k, end=self.pos)
            matched = 0
            while matched < len(guesses) and self.pos + matched < end and guesses[matched] == text[self.pos + matched]:
                matched += 1
            if self.pos + matched < end:
                self.pos += matched + 1
            elif finished:
                self.pos = end
            else:
                break  # it depends on tokens not emitted yet
            steps += 1
        return steps
