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
"""

from __future__ import annotations

from collections.abc import Sequence as Seq


class PromptLookup:
    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        assert 1 <= n_min <= n_max
        self.n_min, self.n_max = n_min, n_max
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence (indexed so far)
        self._indexed = 0  # n-grams ending at positions <= this are in the index
        self._last_offer: tuple[int, int, list[int]] = (-1, 0, [])  # (history length, k, proposal)

    def propose(self, history: Seq[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the history's suffix. A history
        only grows, so its length names it: the router asks up to four times a step (its offer, the
        fill, the wait and the chaining decisions), and the answer is kept for the same length and k."""
        end = len(history)
        if self._last_offer[:2] == (end, k):
            return list(self._last_offer[2])
        self._index(history, end - 1)  # everything but the suffix itself
        offer: list[int] = []
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = self._last.get(tuple(history[end - n:end]))
            if at is not None:
                offer = list(history[at:min(at + k, end)])
                break
        self._last_offer = (end, k, offer)
        return list(offer)

    def _index(self, history: Seq[int], upto: int) -> None:
        for stop in range(max(self._indexed, self.n_min), upto + 1):
            for n in range(self.n_min, min(self.n_max, stop) + 1):
                self._last[tuple(history[stop - n:stop])] = stop
        self._indexed = max(self._indexed, upto + 1)
