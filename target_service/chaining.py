"""Chained steps: a step the router sent before the answer to the step ahead of it came back.

The router cannot know what a verification emits until it answers, so a chained entry names its
history by reference ("continue from what you emitted for this sequence") and carries proposals
keyed by outcome. The service, which knows the outcome first, fills the entry in:

    step t   entry: start_pos p, tokens [x, d1 d2 d3]        -> emitted (d1, y), cached_len p + 2
    step t+1 entry: chained, alternatives {after (d1, y): drafts e1 e2;  after (d1 d2 d3 z): ...}
             becomes start_pos p + 2, tokens [y, e1, e2], num_draft_tokens 2, draft_probs of that one
             (no `after` equal to (d1, y): tokens [y], k = 0)

Losslessness is the router's proposal rule unchanged: drafts are verified only after the very
history they were drafted for, with their own q.
"""

from __future__ import annotations

from engine.runner import InvalidInput
from tandem.v1 import target_pb2

# seq_id -> (cached_len, emitted tokens) of its emitting entry in the stream's last step
Chain = dict[int, tuple[int, list[int]]]


def resolve_chained(request: target_pb2.StepRequest, chain: Chain | None) -> dict[int, int]:
    """Fill in the request's chained entries in place; returns entry index -> StepResult.alternative."""
    chosen: dict[int, int] = {}
    for n, e in enumerate(request.entries):
        if not e.chained:
            if e.alternatives:
                raise InvalidInput(f"entries[{n}].alternatives", "only a chained entry carries alternatives")
            continue
        where = f"entries[{n}]"
        if chain is None:
            raise InvalidInput(f"{where}.chained", "a chained entry needs a StepStream (it continues that "
                                                   "stream's previous step)")
        if e.tokens or e.start_pos or e.num_draft_tokens or e.draft_probs or e.fork_of or e.prefix_block_hashes:
            raise InvalidInput(where, "a chained entry leaves start_pos, tokens, num_draft_tokens, draft_probs, "
                                      "fork_of and prefix_block_hashes to the service")
        if not e.emit:
            raise InvalidInput(f"{where}.emit", "a chained entry decodes: it must emit")
        last = chain.get(e.seq_id)
        if last is None:
            raise InvalidInput(f"{where}.chained", f"sequence {e.seq_id} emitted nothing in this stream's "
                                                   f"previous step")
        cached_len, emitted = last
        index = next((i for i, a in enumerate(e.alternatives) if list(a.after) == emitted), -1)
        e.start_pos = cached_len
        e.tokens.append(emitted[-1])
        if index >= 0:
            alternative = e.alternatives[index]
            e.tokens.extend(alternative.drafts)
            e.num_draft_tokens = len(alternative.drafts)
            e.draft_probs.extend(alternative.draft_probs)
        chosen[n] = index + 1
    return chosen


def remember(chain: Chain, entries: list, results: list[target_pb2.EntryResult]) -> None:
    """After a step: what its emitting entries left for the next step to chain to."""
    chain.clear()
    for e, r in zip(entries, results, strict=True):
        if e.emit and r.tokens:
            chain[r.seq_id] = (r.cached_len, list(r.tokens))
