"""A step's wire form: the entries the router sends the target for a StepPlan, and the logprobs
of its answer as the router's type."""

from __future__ import annotations

from collections.abc import Iterable

from router.core import SeqStatus, TokenLogprob
from router.metrics import Metrics
from router.scheduler import StepPlan
from router.sequence import Sequence
from router.speculation import Proposal
from tandem.v1 import common_pb2, target_pb2


def step_entries(plan: StepPlan, matched: dict[int, Proposal],
                 metrics: Metrics) -> tuple[list[target_pb2.StepEntry], list[list[int]]]:
    """The Step's entries: decodes (each with its proposal from `matched`, cut to its k), prompt chunks,
    then the siblings (n > 1) forked from a prompt it finishes; and the drafts each decode verifies."""
    entries, sent = [], []
    siblings = plan.siblings
    for seq, k in plan.decodes:
        drafts, probs = matched.get(seq.seq_id, ([], []))
        drafts = drafts[:k]
        masks: list[bytes] = []
        if seq.grammar is not None:
            drafts, masks = seq.grammar.masks(drafts)
        n = len(seq.tokens)
        assert seq.target_cached == n - 1, f"seq {seq.seq_id}: target holds {seq.target_cached}, history {n}"
        greedy = seq.request.sampling.greedy
        entries.append(target_pb2.StepEntry(
            seq_id=seq.seq_id, start_pos=n - 1, tokens=[seq.tokens[-1], *drafts], emit=True,
            num_draft_tokens=len(drafts), draft_probs=[] if greedy else probs[:len(drafts)],
            sampling=seq.request.sampling_proto, logprobs=logprobs_wanted(seq), token_masks=masks,
            prompt_len=seq.num_prompt, lora=seq.request.lora, cache_salt=seq.request.salt))
        sent.append(drafts)
    for c in plan.chunks:
        entry = target_pb2.StepEntry(
            seq_id=c.seq.seq_id, start_pos=c.start, tokens=c.seq.tokens[c.start:c.end], emit=c.emit,
            sampling=c.seq.request.sampling_proto, logprobs=logprobs_wanted(c.seq), prompt_len=c.seq.num_prompt,
            prefix_block_hashes=c.attach, lora=c.seq.request.lora, cache_salt=c.seq.request.salt,
            token_masks=c.seq.grammar.masks([])[1] if c.emit and c.seq.grammar is not None else [])
        if scores_prompt(c.seq):
            entry.prompt_logprobs = c.seq.request.prompt_logprobs  # type: ignore[assignment]
            if not c.emit:
                entry.next_prompt_token = c.seq.tokens[c.end]
        entries.append(entry)
        metrics.prompt_tokens_computed.inc(c.end - c.start)
        if c.emit:
            siblings.extend(s for s in c.seq.forks if s.waits_for_fork and s.status is SeqStatus.RUNNING)
    for s in siblings:  # the prompt is computed once: each sibling forks it and samples its own first token
        entries.append(target_pb2.StepEntry(
            seq_id=s.seq_id, start_pos=s.num_prompt, emit=True, fork_of=s.fork_parent.seq_id,  # type: ignore[union-attr]
            sampling=s.request.sampling_proto, logprobs=logprobs_wanted(s), prompt_len=s.num_prompt,
            lora=s.request.lora, cache_salt=s.request.salt,
            token_masks=s.grammar.masks([])[1] if s.grammar is not None else []))
    metrics.grammar_mask_bytes.inc(sum(len(m) for e in entries for m in e.token_masks))
    return entries, sent


def logprobs_wanted(seq: Sequence) -> int:
    """StepEntry.logprobs for seq: top alternatives per emitted token, -1 for none."""
    return -1 if seq.request.logprobs is None else seq.request.logprobs


def scores_prompt(seq: Sequence) -> bool:
    """Whether seq's prompt chunks ask for their prompt tokens' logprobs: echo asked for them, and its
    first token is not out yet (a recompute after that has nothing to add)."""
    return seq.request.prompt_logprobs is not None and seq.output is not None and not seq.output.prompt_scored


def logprobs_of(res: target_pb2.EntryResult) -> list[TokenLogprob] | None:
    if not res.logprobs:
        return None
    return _converted(res.logprobs)


def _converted(lps: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=True)), lp.rank)
            for lp in lps]


def prompt_logprobs_of(res: target_pb2.EntryResult) -> list[TokenLogprob]:
    return _converted(res.prompt_logprobs)
