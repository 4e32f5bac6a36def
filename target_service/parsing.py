"""A StepRequest as engine inputs, checked completely before anything runs (no side effects): every
field only the target can judge is checked here; cache state, capacity, duplicates and token ids
are checked by ModelRunner.forward before it changes anything.

A sequence sends the same SamplingParams on every step, so its checked form (processors, sampling
spec, acceptance rule) is kept per distinct message (common/checked.py): on a 16-sequence step of
the demo target that was most of the service's own time around the model (bench.step_profile).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from common.checked import CheckedOnce
from common.protocol import MAX_LOGPROBS
from common.sampling import InvalidField
from engine.logits import Processors
from engine.rpc import sampling_spec
from engine.runner import InvalidInput, SeqInput
from engine.sampling import SamplingSpec
from tandem.v1 import common_pb2, target_pb2
from target_service.acceptance import DEFAULT_TYPICAL_DELTA, DEFAULT_TYPICAL_EPSILON, Rule, SparseDist, Verification

_SUM_TOLERANCE = 1e-4  # a sparse q may sum to 1 + float32 rounding


@dataclass(frozen=True)
class Entry:
    seq: SeqInput
    emit: bool
    k: int
    verification: Verification | None  # None when emit is false
    logprobs: int  # -1: none
    processors: Processors | None = None
    masks: tuple[bytes, ...] = ()
    fork_of: int = 0
    prompt_logprobs: int = -1  # top alternatives of the prompt tokens' logprobs; -1: none asked
    prompt_targets: tuple[int, ...] = ()  # the prompt token each of the first len() positions scores

    @property
    def sibling(self) -> bool:
        """n choices: a fork sampled from its parent's last logits in this step (no tokens of its own)."""
        return not self.seq.tokens

    @property
    def needs_history(self) -> bool:
        return self.processors is not None and self.processors.needs_history


@dataclass(frozen=True)
class _Sampling:
    """One SamplingParams message, checked: what an emitting entry samples and accepts with."""

    processors: Processors | None
    spec: SamplingSpec | None  # None: checked for a non-emitting entry only (processors)
    rule: Rule = Rule.STRICT
    typical: tuple[float, float] = (DEFAULT_TYPICAL_EPSILON, DEFAULT_TYPICAL_DELTA)


class StepParser:
    def __init__(self, vocab_size: int, max_model_len: int, max_draft_tokens: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_draft_tokens = max_draft_tokens
        self._checked = CheckedOnce(self._check_sampling)

    def parse(self, request: target_pb2.StepRequest) -> list[Entry]:
        """The request as engine inputs, or InvalidInput naming the first bad field."""
        if not request.entries:
            raise InvalidInput("entries", "empty batch")
        return [self._entry(n, e) for n, e in enumerate(request.entries)]

    def _entry(self, n: int, e: target_pb2.StepEntry) -> Entry:
        where = f"entries[{n}]"
        tokens = list(e.tokens)
        k = e.num_draft_tokens
        if not tokens and not (e.fork_of and e.emit and not k):
            raise InvalidInput(f"{where}.tokens", "must not be empty (but in fork_of's sibling form)")
        field_k = f"{where}.num_draft_tokens"
        if not e.emit and k:
            raise InvalidInput(field_k, f"{k} draft tokens with emit = false: nothing would judge them")
        if k > self.max_draft_tokens:
            raise InvalidInput(field_k, f"{k} exceeds max_draft_tokens {self.max_draft_tokens}")
        if k >= len(tokens) and tokens:
            raise InvalidInput(field_k, f"{k} draft tokens need {k + 1} tokens (the last emitted one first), "
                                        f"got {len(tokens)}")
        if e.emit and e.start_pos + len(tokens) >= self.max_model_len:
            raise InvalidInput(f"{where}.start_pos", f"{e.start_pos} + {len(tokens)} tokens leaves no room under "
                                                     f"max_model_len {self.max_model_len} for the emitted token")
        if not -1 <= e.logprobs <= MAX_LOGPROBS:
            raise InvalidInput(f"{where}.logprobs", f"must be -1 (none) or in [0, {MAX_LOGPROBS}], got {e.logprobs}")
        prompt_top, targets = self._prompt_logprobs(e, tokens, k, where)
        seq = SeqInput(e.seq_id, e.start_pos, tokens, num_logits=len(tokens) if prompt_top >= 0 else
                       k + 1 if e.emit else 0, prefix=list(e.prefix_block_hashes), adapter=e.lora,
                       salt=e.cache_salt)
        sampling = self._sampling(e, where)
        if e.token_masks and (not e.emit or len(e.token_masks) != k + 1):
            raise InvalidInput(f"{where}.token_masks", f"{len(e.token_masks)} masks: an emitting entry needs one per "
                                                       f"decided position ({k + 1})")
        try:
            masks = tuple(zlib.decompress(m) for m in e.token_masks)
        except zlib.error as err:
            raise InvalidInput(f"{where}.token_masks", f"not a zlib-compressed bitmask: {err}") from None
        if any(not m.strip(b"\0") for m in masks):
            raise InvalidInput(f"{where}.token_masks", "a mask allows no token at all")
        if not e.emit:
            return Entry(seq, False, 0, None, -1, sampling.processors, fork_of=e.fork_of, prompt_logprobs=prompt_top,
                         prompt_targets=targets)
        assert sampling.spec is not None
        draft = tokens[len(tokens) - k:]
        dists = self._draft_dists(e, draft, where)
        if sampling.rule == Rule.STRICT and not sampling.spec.greedy and k and not dists:
            raise InvalidInput(f"{where}.draft_probs", f"strict sampling (temperature > 0) needs the draft's "
                                                       f"distribution at each of the {k} draft positions")
        eps, delta = sampling.typical
        verification = Verification(draft=draft, spec=sampling.spec, position=e.start_pos + len(tokens) - k,
                                    draft_dists=dists, rule=sampling.rule, typical_epsilon=eps, typical_delta=delta)
        return Entry(seq, True, k, verification, e.logprobs, sampling.processors, masks, e.fork_of, prompt_top, targets)

    def _prompt_logprobs(self, e: target_pb2.StepEntry, tokens: list[int], k: int,
                         where: str) -> tuple[int, tuple[int, ...]]:
        """(top alternatives, the prompt token each position scores) of a chunk asking for its prompt
        tokens' logprobs (StepEntry.prompt_logprobs); (-1, ()) when it does not."""
        after = f"{where}.next_prompt_token"
        if not e.HasField("prompt_logprobs"):
            if e.HasField("next_prompt_token"):
                raise InvalidInput(after, "only with prompt_logprobs")
            return -1, ()
        field = f"{where}.prompt_logprobs"
        if not 0 <= e.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidInput(field, f"must be in [0, {MAX_LOGPROBS}], got {e.prompt_logprobs}")
        if k or e.chained or not tokens:
            raise InvalidInput(field, "a prompt chunk's: not with draft tokens, chained or in the sibling form")
        if e.emit:
            if e.HasField("next_prompt_token"):
                raise InvalidInput(after, "the last chunk's last position yields the emitted token, no prompt token")
            return e.prompt_logprobs, tuple(tokens[1:])
        if not e.HasField("next_prompt_token"):
            raise InvalidInput(after, "required with prompt_logprobs when emit is false")
        if not 0 <= e.next_prompt_token < self.vocab_size:
            raise InvalidInput(after, f"token id outside [0, {self.vocab_size})")
        return e.prompt_logprobs, (*tokens[1:], e.next_prompt_token)

    def _sampling(self, e: target_pb2.StepEntry, where: str) -> _Sampling:
        """e.sampling checked (as far as the entry uses it), once per distinct message."""
        key = (e.sampling.SerializeToString(deterministic=True), e.prompt_len, e.emit)
        return self._checked.get(key, e, where)

    def _check_sampling(self, e: target_pb2.StepEntry, where: str) -> _Sampling:
        try:
            processors = Processors.from_proto(e.sampling, e.prompt_len, self.vocab_size)
        except InvalidField as err:
            raise InvalidInput(f"{where}.sampling.{err.field}", str(err).split(": ", 1)[-1]) from None
        if not e.emit:
            return _Sampling(processors, None)
        field = f"{where}.sampling"
        try:
            rule = Rule(e.sampling.acceptance)
        except ValueError:
            raise InvalidInput(f"{field}.acceptance", f"unknown acceptance rule {e.sampling.acceptance}") from None
        return _Sampling(processors, sampling_spec(e.sampling, field), rule, _typical_params(e.sampling, field))

    def _draft_dists(self, e: target_pb2.StepEntry, draft: list[int], where: str) -> list[SparseDist]:
        """The draft's sparse q per draft position; [] when none were sent (greedy, typical)."""
        if not e.draft_probs:
            return []
        if len(e.draft_probs) != len(draft):
            raise InvalidInput(f"{where}.draft_probs",
                               f"{len(e.draft_probs)} distributions for {len(draft)} draft tokens")
        dists = []
        for i, (d, token) in enumerate(zip(e.draft_probs, draft, strict=True)):
            field = f"{where}.draft_probs[{i}]"
            ids, probs = list(d.token_ids), list(d.probs)
            if len(ids) != len(probs):
                raise InvalidInput(field, f"{len(ids)} token_ids but {len(probs)} probs")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidInput(f"{field}.token_ids", f"token id outside [0, {self.vocab_size})")
            if len(set(ids)) != len(ids):
                raise InvalidInput(f"{field}.token_ids", "ids must be distinct")
            if any(not 0.0 <= p <= 1.0 for p in probs):  # NaN fails too
                raise InvalidInput(f"{field}.probs", "each probability must be in [0, 1]")
            if sum(probs) > 1.0 + _SUM_TOLERANCE:
                raise InvalidInput(f"{field}.probs", f"sum {sum(probs):.6f} exceeds 1")
            if token not in ids or probs[ids.index(token)] <= 0.0:
                raise InvalidInput(field, f"draft token {token} has no probability in its own distribution")
            dists.append(SparseDist(ids, probs))
        return dists


def _typical_params(params: common_pb2.SamplingParams, field: str) -> tuple[float, float]:
    eps = params.typical_epsilon or DEFAULT_TYPICAL_EPSILON
    delta = params.typical_delta or DEFAULT_TYPICAL_DELTA
    if not 0.0 < eps <= 1.0:
        raise InvalidInput(f"{field}.typical_epsilon", f"must be in (0, 1] (0 = default), got {eps}")
    if not (0.0 < delta and math.isfinite(delta)):
        raise InvalidInput(f"{field}.typical_delta", f"must be > 0 (0 = default), got {delta}")
    return eps, delta
