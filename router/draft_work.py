"""What one Propose call carries (DraftWork), built by the speculator and sent by the draft lane.

Position bookkeeping per sequence (router.sequence.Sequence): the draft holds draft_stream[:draft_cached].
A call continues a base stream S (the history, plus the drafts being verified right now); the
draft keeps the common prefix of what it holds and S and is fed the rest, always including the
token before the drafts under verification (the branches fork from their logits):

    draft holds:  t0 t1 t2 t3 d1 d2          (stale d's after a rejection)
    base S:       t0 t1 t2 t3 x  e1 e2       (x: the target's token; e1 e2 being verified now)
    call:         start_pos = 4, tokens = [x, e1, e2], num_verifying = 2, branches = [(j, rank), ...]

A sequence starting at the draft with a cached prefix (router.prefix) holds it on paper already
(draft_stream = the prefix): its first entry starts after it and names its blocks, so the prompt
mirroring skips what the draft has cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.sequence import Sequence
from tandem.v1 import common_pb2, draft_pb2

CATCH_UP_IN_PROPOSE = 64  # a sequence lagging further (a restarted draft) catches up without a proposal first


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search the first difference
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class DraftWork:
    """One Propose call: what each sequence's draft cache must end up holding, and what to prepare."""

    entries: list[draft_pb2.ProposeEntry] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    bases: list[list[int]] = field(default_factory=list)  # the stream each entry continues
    epochs: list[int] = field(default_factory=list)  # the sequences' cache epochs when the call was built
    tokens: int = 0
    branches: int = 0
    rounds: int = 0
    due: float = 0.0  # perf_counter() by which the call should land (the step it is prepared beside); 0: none

    def add(self, seq: Sequence, base: list[int], k: int, v: int, sampling: common_pb2.SamplingParams,
            branches: list[tuple[int, int]], budget: int) -> bool:
        """Add seq's entry unless the draft's batch budget is spent; False when it was not added."""
        held = seq.draft_stream[: seq.draft_cached]
        fork_of = 0
        parent = seq.fork_parent
        if not held and parent is not None and not parent.finished and parent.draft_cached >= seq.num_prompt:
            held, fork_of = parent.draft_stream[: seq.num_prompt], parent.seq_id  # n > 1: share its prompt's KV
        start = common_prefix(held, base, len(base) - v - 1 if k else len(base))
        fork_of = fork_of if start else 0
        tokens = base[start:]
        if not tokens:
            return True
        a = seq.prefix.draft
        attach = a.hashes if a is not None and not a.confirmed and seq.draft_cached == a.tokens else ()
        assert not attach or start == a.tokens, "a cached prefix is attached before anything follows it"
        if len(tokens) > CATCH_UP_IN_PROPOSE and k:  # far behind: catch up now (history only), propose next time
            tokens, k, v, branches = tokens[:min(CATCH_UP_IN_PROPOSE, len(tokens) - v)], 0, 0, []
            base = base[: start + len(tokens)]
        if self.tokens + len(tokens) > budget or self.branches + len(branches) > budget:
            return False
        self.entries.append(draft_pb2.ProposeEntry(
            seq_id=seq.seq_id, start_pos=start, tokens=tokens, k=k, sampling=sampling, num_verifying=v,
            branches=[draft_pb2.Branch(accepted=j, rank=r) for j, r in branches], prompt_len=seq.num_prompt,
            # a grammar that waits for the thinking to end stays with the router (which cuts the drafts it refuses)
            grammar=seq.request.grammar if start == 0 and seq.request.grammar_opens_after is None else "",
            fork_of=fork_of,
            prefix_block_hashes=attach, cache_salt=seq.request.salt))
        if k:
            seq.asked_at = len(base) - v  # the outcome of the verification in flight (speculator.miss_kind)
        self.seqs.append(seq)
        self.bases.append(base)
        self.epochs.append(seq.cache_epoch)
        self.tokens += len(tokens)
        self.branches += len(branches)
        self.rounds = max(self.rounds, 1 + k if branches else max(k, 1))
        return True
