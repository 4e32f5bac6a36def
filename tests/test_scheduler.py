"""Scheduler specification, without services.

A fake target (`FakeTarget`) applies each StepPlan the way the real one does: position-addressed
(trim to start_pos, then append; holding less than start_pos is a cache miss), each cached position
holding a hash of the whole prefix (as a real KV cache holds state that depends on every earlier
token), greedy emission, and greedy verification of the k drafts a fake draft proposes (right for
a deterministic number of positions, then wrong). Its greedy output is therefore a function of the
token history alone, so any way of scheduling -- chunk sizes, k, preemption and recompute -- must
produce exactly the reference continuation.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import RouterConfig
from router.core import GREEDY, Request, SeqStatus
from router.scheduler import CacheGeometry, Scheduler, StepPlan
from router.sequence import Sequence

VOCAB = 50_000
MASK = (1 << 61) - 1


# ---- the deterministic fake model -------------------------------------------------------------
def _state(prev: int, token: int) -> int:
    return hash((prev, token)) & MASK


def _greedy(state: int) -> int:
    return state % VOCAB


def reference_continuation(history: list[int], n: int) -> list[int]:
    """What plain greedy decoding of the fake model appends to history: n tokens, one at a time."""
    state = 0
    for t in history:
        state = _state(state, t)
    out = []
    for _ in range(n):
        tok = _greedy(state)
        out.append(tok)
        state = _state(state, tok)
    return out


def fake_draft(history: list[int], k: int) -> list[int]:
    """k proposals: the target's greedy continuation for a deterministic number of positions, then wrong."""
    good = hash((len(history), history[-1], 12345)) % (k + 1)
    drafts = reference_continuation(history, k)
    if good < k:
        drafts[good] = (drafts[good] + 1) % VOCAB
    return drafts


class CacheMiss(Exception):
    pass


class FakeTarget:
    """A position-addressed KV cache of the fake model, with real block accounting."""

    def __init__(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry
        self.kv: dict[int, list[int]] = {}  # seq_id -> per-position prefix state

    def _write(self, seq_id: int, start: int, tokens: list[int]) -> list[int]:
        kv = self.kv.setdefault(seq_id, [])
        if len(kv) < start:
            raise CacheMiss(seq_id)
        del kv[start:]
        for t in tokens:
            kv.append(_state(kv[-1] if kv else 0, t))
        return kv

    def blocks_held(self) -> int:
        return sum(self.geometry.blocks(len(kv)) for kv in self.kv.values())

    def step(self, plan: StepPlan) -> dict[int, tuple[list[int], int]]:
        """seq_id -> (emitted tokens, cached_len). Checks the cache never overflows mid-step."""
        results = {}
        for seq, k in plan.decodes:
            n = len(seq.tokens)
            drafts = fake_draft(seq.tokens, k)
            kv = self._write(seq.seq_id, n - 1, [seq.tokens[-1], *drafts])
            emitted = []
            for i in range(k + 1):
                tok = _greedy(kv[n - 1 + i])
                emitted.append(tok)
                if i == k or drafts[i] != tok:
                    break
            accepted = len(emitted) - 1
            results[seq.seq_id] = (emitted, n + accepted)
        for c in plan.chunks:
            kv = self._write(c.seq.seq_id, c.start, c.seq.tokens[c.start:c.end])
            results[c.seq.seq_id] = ([_greedy(kv[-1])] if c.emit else [], c.end)
        assert self.blocks_held() <= self.geometry.num_blocks, "the target's KV cache overflowed"
        for seq_id, (_, cached_len) in results.items():  # rollback of rejected drafts
            del self.kv[seq_id][cached_len:]
        return results

    def release(self, seq_id: int) -> None:
        self.kv.pop(seq_id, None)


# ---- driving the scheduler like the step loop does --------------------------------------------
def all_k_max(config: RouterConfig) -> Callable[[list[Sequence], int], list[int]]:
    return lambda decoders, prefill_tokens: [config.k_max] * len(decoders)


def wild_ks(decoders: list[Sequence], prefill_tokens: int) -> list[int]:
    """A policy that asks for anything from 0 to well past k_max; the scheduler must cap it."""
    return [hash((s.seq_id, len(s.tokens))) % 20 for s in decoders]


def make_seq(seq_id: int, prompt: list[int], max_tokens: int, priority: int = 0) -> Sequence:
    req = Request(request_id=f"r{seq_id}", prompt_ids=list(prompt), sampling=GREEDY, max_tokens=max_tokens,
                  priority=priority)
    return Sequence(seq_id=seq_id, request=req, tokens=list(prompt), num_prompt=len(prompt))


def prompt_of(seq_id: int, length: int) -> list[int]:
    return [(seq_id * 7919 + i * 31) % VOCAB for i in range(length)]


class Sim:
    """The router side of the loop: schedule, run the fake target, apply what it emitted (surplus
    past max_tokens dropped, as OutputBuilder does), release finished and preempted sequences."""

    def __init__(self, config: RouterConfig, target: CacheGeometry, draft: CacheGeometry | None,
                 choose_ks: Callable[[list[Sequence], int], list[int]] | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config, target, draft)
        self.service = FakeTarget(target)
        self.choose_ks = choose_ks or all_k_max(config)
        self.plans: list[StepPlan] = []
        self.finished: list[Sequence] = []
        self.admitted: list[Sequence] = []  # order of first admission
        # seq_id -> prefill passes (the first, then one per preemption): (start, end, emit, len(history))
        self.passes: dict[int, list[list[tuple[int, int, bool, int]]]] = {}
        self.choose_calls: list[tuple[int, int]] = []  # (len(decoders), prefill_tokens)
        self.rounds: list[tuple[list[Sequence], list[Sequence]]] = []  # per step: (admitted, left waiting)

    def _choose(self, decoders: list[Sequence], prefill_tokens: int) -> list[int]:
        self.choose_calls.append((len(decoders), prefill_tokens))
        return self.choose_ks(decoders, prefill_tokens)

    def step(self) -> StepPlan:
        before = set(map(id, self.scheduler.running))
        plan = self.scheduler.schedule(self._choose)
        self.rounds.append(([s for s in self.scheduler.running if id(s) not in before], list(self.scheduler.waiting)))
        check_step_invariants(self.scheduler, plan)
        for seq in plan.preempted:
            self.service.release(seq.seq_id)  # the loop must drop a preempted sequence's caches
            self.passes.setdefault(seq.seq_id, [[]]).append([])
        for seq in self.scheduler.running:
            if seq not in self.admitted:
                self.admitted.append(seq)
        for c in plan.chunks:
            self.passes.setdefault(c.seq.seq_id, [[]])[-1].append((c.start, c.end, c.emit, len(c.seq.tokens)))
        results = self.service.step(plan)
        for seq in [s for s, _ in plan.decodes] + [c.seq for c in plan.chunks]:
            emitted, cached_len = results[seq.seq_id]
            seq.target_cached = seq.draft_cached = cached_len
            room = seq.request.max_tokens - seq.num_output
            seq.tokens.extend(emitted[:room])
            if seq.num_output >= seq.request.max_tokens:
                seq.finished, seq.status = True, SeqStatus.FINISHED
                self.scheduler.remove(seq)
                self.service.release(seq.seq_id)
                self.finished.append(seq)
        self.plans.append(plan)
        return plan

    def run(self, arrivals: list[tuple[int, Sequence]], max_steps: int = 5000) -> dict[int, list[int]]:
        """arrivals: (step at which it arrives, sequence). Runs until every sequence finished."""
        pending = sorted(arrivals, key=lambda a: a[0])
        for t in itertools.count():
            assert t < max_steps, "no progress: the scheduler livelocked"
            while pending and pending[0][0] <= t:
                self.scheduler.add(pending.pop(0)[1])
            if not pending and not self.scheduler.running and not self.scheduler.waiting:
                break
            plan = self.step()
            if not pending:
                assert not plan.empty, "work is queued but the step is empty"
        return {s.seq_id: s.tokens for s in self.finished}


def check_step_invariants(sched: Scheduler, plan: StepPlan) -> None:
    """What every plan must satisfy, whatever the workload."""
    cfg = sched.config
    t, d = sched.usage()
    assert t <= sched.target.num_blocks, "target KV reservations exceed the cache"
    if sched.draft is not None:
        assert d <= sched.draft.num_blocks, "draft KV reservations exceed the cache"
    assert len(sched.running) <= cfg.max_num_seqs
    in_plan = [s for s, _ in plan.decodes] + [c.seq for c in plan.chunks]
    assert len(in_plan) == len(set(map(id, in_plan))), "a sequence appears twice in one step"
    assert all(s in sched.running for s in in_plan), "only running sequences are stepped"
    for seq in plan.preempted:
        assert seq not in sched.running and seq in sched.waiting and seq.target_cached == 0
    for seq, k in plan.decodes:
        assert 0 <= k <= cfg.k_max
        assert seq.target_cached == len(seq.tokens) - 1, "a decode must find its history cached but the last token"
    for c in plan.chunks:
        assert c.start == c.seq.target_cached < c.end <= len(c.seq.tokens), "chunks continue the cached prefix"
    prefilling = [s for s in sched.running if s.prefilling]
    if cfg.chunked_prefill:
        assert plan.num_tokens <= cfg.max_num_batched_tokens, "the token budget was exceeded"
        decoders = [s for s in sched.running if not s.prefilling]
        assert {id(s) for s, _ in plan.decodes} == {id(s) for s in decoders}, "a running decode was starved"
        # work-conserving: budget left after decodes goes to prompts
        if prefilling and plan.num_tokens < cfg.max_num_batched_tokens:
            assert {id(c.seq) for c in plan.chunks} == {id(s) for s in prefilling}
            assert all(c.emit for c in plan.chunks)
    elif prefilling:
        assert not plan.decodes, "prefill-first: no decodes while prompts are pending"
        assert plan.chunks and all(c.emit for c in plan.chunks), "prefill-first: whole prompts only"
        assert plan.num_tokens <= cfg.max_num_batched_tokens or len(plan.chunks) == 1


# ---- properties --------------------------------------------------------------------------------
workloads = st.fixed_dictionaries({
    "budget": st.integers(4, 48),
    "max_num_seqs": st.integers(1, 8),
    "k_max": st.integers(0, 4),
    "block_size": st.sampled_from([1, 2, 4, 8, 16]),
    "chunked": st.booleans(),
    "with_draft": st.booleans(),
    "slack_t": st.integers(0, 24),
    "slack_d": st.integers(0, 24),
    "wild_k": st.booleans(),
    "requests": st.lists(st.tuples(st.integers(0, 12), st.integers(1, 60), st.integers(1, 20)),
                         min_size=1, max_size=8),  # (arrival step, prompt length, max_tokens)
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_any_workload_keeps_invariants_and_matches_reference_output(w):
    """Budget, no starvation, reservations within both caches, max_num_seqs, FCFS, contiguous
    chunks ending in an emitting chunk; and with tight caches (preemption + recompute) every
    sequence ends exactly as plain greedy decoding and as a run with ample capacity."""
    config = RouterConfig(max_num_batched_tokens=w["budget"], max_num_seqs=min(w["max_num_seqs"], w["budget"]),
                          k_max=w["k_max"], chunked_prefill=w["chunked"])
    bs, la = w["block_size"], w["k_max"] + 1
    longest = max(p + m for _, p, m in w["requests"])
    # the engine refuses at the door what could never fit alone (fits_ever); size caches just above that
    target = CacheGeometry(-(-(longest + la) // bs) + w["slack_t"], bs)
    draft = CacheGeometry(-(-(longest + 2 * la) // bs) + w["slack_d"], bs) if w["with_draft"] else None
    ample = CacheGeometry(100_000, bs)

    def arrivals():
        return [(at, make_seq(i, prompt_of(i, p), m)) for i, (at, p, m) in enumerate(w["requests"])]

    tight = Sim(config, target, draft, wild_ks if w["wild_k"] else None)
    assert all(tight.scheduler.fits_ever(p + m) for _, p, m in w["requests"])
    out = tight.run(arrivals())
    roomy = Sim(config, ample, ample if draft else None, wild_ks if w["wild_k"] else None)
    ref_out = roomy.run(arrivals())

    assert len(out) == len(w["requests"])
    for i, (_, p, m) in enumerate(w["requests"]):
        prompt = prompt_of(i, p)
        assert out[i] == prompt + reference_continuation(prompt, m)
        assert out[i] == ref_out[i]
    # FCFS: first admissions happen in arrival order
    assert [s.seq_id for s in tight.admitted] == [i for _, i in sorted((at, i) for i, (at, _, _) in
                                                                       enumerate(w["requests"]))]
    # each prefill pass (the first, and one per preemption) is contiguous from 0 and only its last chunk
    # may emit. A pass that ran to its end either emitted, or -- a recompute whose chunk boundary fell
    # one short of the history -- stopped at len - 1 and handed over to the decode path, which feeds
    # the last token (a first prefill has no output yet, so it always ends emitting).
    for seq in tight.finished:
        passes = tight.passes[seq.seq_id]
        assert len(passes) == seq.num_preemptions + 1
        for run in passes:
            assert not run or run[0][0] == 0
            assert all(x[1] == y[0] for x, y in itertools.pairwise(run)), "chunks of one pass are contiguous"
            assert not any(c[2] for c in run[:-1]), "only the last chunk of a pass emits"
        _, end, emit, hist = passes[-1][-1]
        assert emit or (seq.num_preemptions and end == hist - 1)
        if not seq.num_preemptions:
            assert passes[0][-1] == (passes[0][-1][0], seq.num_prompt, True, seq.num_prompt)
    for n_decoders, prefill_tokens in tight.choose_calls:
        assert 0 <= prefill_tokens <= config.max_num_batched_tokens - n_decoders


# ---- chunked prefill -----------------------------------------------------------------------------
def test_long_prompt_is_chunked_across_steps_while_a_decode_runs_every_step():
    config = RouterConfig(max_num_batched_tokens=16, max_num_seqs=4, k_max=2)
    sim = Sim(config, CacheGeometry(1000, 4), CacheGeometry(1000, 4))
    short = make_seq(1, prompt_of(1, 3), max_tokens=50)
    sim.scheduler.add(short)
    sim.step()  # short prefills and emits its first token: now it decodes
    long = make_seq(2, prompt_of(2, 100), max_tokens=5)
    sim.scheduler.add(long)
    chunks = []
    while long.prefilling:
        plan = sim.step()
        assert [s for s, _ in plan.decodes] == [short], "the decode runs in every step of the long prefill"
        (chunk,) = plan.chunks
        assert plan.num_tokens == 16 or chunk.emit, "decode (1 + k) plus a chunk filling the rest of the budget"
        chunks.append((chunk.start, chunk.end, chunk.emit))
    assert len(chunks) >= 100 // 16
    assert chunks[0][0] == 0 and chunks[-1][1] == 100
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks)), "contiguous"
    assert [c[2] for c in chunks] == [False] * (len(chunks) - 1) + [True], "only the last chunk emits"
    assert long.num_output == 1 and long.tokens[100:] == reference_continuation(prompt_of(2, 100), 1)


def test_several_prompts_prefill_in_one_step():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, k_max=4)
    sim = Sim(config, CacheGeometry(1000, 4), CacheGeometry(1000, 4))
    seqs = [make_seq(i, prompt_of(i, 10), max_tokens=4) for i in range(3)]
    for s in seqs:
        sim.scheduler.add(s)
    plan = sim.step()
    assert [(c.seq, c.start, c.end, c.emit) for c in plan.chunks] == [(s, 0, 10, True) for s in seqs]
    assert all(s.num_output == 1 for s in seqs)


def test_budget_left_by_decodes_goes_to_the_oldest_prompt_first():
    config = RouterConfig(max_num_batched_tokens=12, max_num_seqs=4, k_max=0)
    sim = Sim(config, CacheGeometry(1000, 4), None)
    a, b = make_seq(1, prompt_of(1, 10), 4), make_seq(2, prompt_of(2, 10), 4)
    sim.scheduler.add(a)
    sim.scheduler.add(b)
    plan = sim.step()
    assert [(c.seq, c.start, c.end) for c in plan.chunks] == [(a, 0, 10), (b, 0, 2)]
    plan = sim.step()
    assert plan.decodes == [(a, 0)] and [(c.seq, c.start, c.end) for c in plan.chunks] == [(b, 2, 10)]


def test_k_is_capped_by_k_max_and_by_the_budget():
    config = RouterConfig(max_num_batched_tokens=6, max_num_seqs=4, k_max=4)
    sim = Sim(config, CacheGeometry(1000, 4), None, choose_ks=lambda ds, p: [99] * len(ds))
    seqs = [make_seq(i, prompt_of(i, 2), max_tokens=30) for i in range(2)]
    for s in seqs:
        sim.scheduler.add(s)
    sim.step()  # 2 + 2 prompt tokens, both emit
    plan = sim.step()
    # two decodes cost 2; the first takes k = min(99, k_max, 4 left) = 4, the second what is left: 0
    assert plan.decodes == [(seqs[0], 4), (seqs[1], 0)]
    assert plan.num_tokens == 6


def test_choose_ks_sees_the_prefill_tokens_left_after_decodes():
    config = RouterConfig(max_num_batched_tokens=20, max_num_seqs=4, k_max=2)
    seen = []
    sim = Sim(config, CacheGeometry(1000, 4), None,
              choose_ks=lambda ds, p: seen.append((list(ds), p)) or [0] * len(ds))
    a = make_seq(1, prompt_of(1, 4), 20)
    sim.scheduler.add(a)
    sim.step()
    sim.scheduler.add(make_seq(2, prompt_of(2, 50), 20))
    sim.step()
    assert seen == [([a], 19)], "one decode token, then 19 tokens of the 50 pending fit the budget"


def test_decode_not_ready_waits_without_blocking_others():
    config = RouterConfig(max_num_batched_tokens=32, max_num_seqs=4, k_max=2)
    sched = Scheduler(config, CacheGeometry(1000, 4), None)
    a, b = make_seq(1, prompt_of(1, 4), 10), make_seq(2, prompt_of(2, 4), 10)
    for s in (a, b):
        s.tokens.append(7)
        s.target_cached = len(s.tokens) - 1
        sched.add(s)
    plan = sched.schedule(lambda ds, p: [2] * len(ds), decode_ready=lambda s: s is not a)
    assert plan.decodes == [(b, 2)] and not plan.chunks


# ---- prefill-first mode --------------------------------------------------------------------------
def test_prefill_first_runs_whole_prompts_and_no_decodes_while_prompts_pend():
    config = RouterConfig(max_num_batched_tokens=16, max_num_seqs=4, k_max=2, chunked_prefill=False)
    sim = Sim(config, CacheGeometry(1000, 4), None)
    a = make_seq(1, prompt_of(1, 5), max_tokens=20)
    sim.scheduler.add(a)
    sim.step()
    assert a.num_output == 1
    for i, n in ((2, 6), (3, 6), (4, 40)):
        sim.scheduler.add(make_seq(i, prompt_of(i, n), max_tokens=3))
    plan = sim.step()
    assert not plan.decodes
    assert [(c.seq.seq_id, c.start, c.end, c.emit) for c in plan.chunks] == [(2, 0, 6, True), (3, 0, 6, True)]
    plan = sim.step()  # a prompt longer than the whole budget still goes in one piece, alone
    assert not plan.decodes and [(c.seq.seq_id, c.start, c.end) for c in plan.chunks] == [(4, 0, 40)]
    plan = sim.step()  # nothing pending: everyone decodes
    assert {s.seq_id for s, _ in plan.decodes} == {1, 2, 3, 4} and not plan.chunks


# ---- admission and capacity --------------------------------------------------------------------------
def test_admission_needs_room_in_the_draft_cache_too():
    config = RouterConfig(max_num_batched_tokens=256, max_num_seqs=32, k_max=2)
    # an 11-token prompt reserves blocks(11 + 3) = 4 target blocks (history + k + 1 verification slots)
    # and blocks(11 + 6) = 5 draft blocks (the draft also holds the optimistic next proposal, k + 1 more)
    big, tiny = CacheGeometry(1000, 4), CacheGeometry(9, 4)
    for target, draft, admitted in ((big, tiny, 1), (tiny, big, 2), (big, None, 10), (big, big, 10)):
        sched = Scheduler(config, target, draft)
        seqs = [make_seq(i, prompt_of(i, 11), 4) for i in range(10)]
        for s in seqs:
            sched.add(s)
        sched.schedule(all_k_max(config))
        assert sched.running == seqs[:admitted], (target, draft)
        assert list(sched.waiting) == seqs[admitted:]
        assert all(s.status is SeqStatus.RUNNING for s in sched.running)
        assert all(s.status is SeqStatus.WAITING for s in sched.waiting)


def test_admission_is_fcfs_a_big_head_blocks_smaller_requests_behind_it():
    config = RouterConfig(max_num_batched_tokens=256, max_num_seqs=32, k_max=0)
    sched = Scheduler(config, CacheGeometry(10, 4), None)
    first, big, small = make_seq(1, prompt_of(1, 19), 4), make_seq(2, prompt_of(2, 30), 4), make_seq(3, [1], 4)
    for s in (first, big, small):
        sched.add(s)
    sched.schedule(all_k_max(config))
    assert sched.running == [first]  # 5 blocks left: small (1 block) would fit, big (8) does not
    assert list(sched.waiting) == [big, small]


def test_max_num_seqs_bounds_the_running_set():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=2, k_max=1)
    sim = Sim(config, CacheGeometry(1000, 4), None)
    seqs = [make_seq(i, prompt_of(i, 5), max_tokens=3 + i) for i in range(5)]
    out = sim.run([(0, s) for s in seqs])
    assert max(len(p.decodes) + len(p.chunks) for p in sim.plans) == 2
    assert sim.admitted == seqs
    assert all(out[s.seq_id] == s.tokens[:5] + reference_continuation(s.tokens[:5], s.request.max_tokens)
               for s in seqs)


def test_fits_ever_counts_the_lookahead_of_both_caches():
    config = RouterConfig(k_max=4)  # lookahead: 5 target slots, 10 draft slots
    target_only = Scheduler(config, CacheGeometry(10, 4), None)  # 40 slots
    assert target_only.fits_ever(35) and not target_only.fits_ever(36)
    both = Scheduler(config, CacheGeometry(10, 4), CacheGeometry(10, 4))
    assert both.fits_ever(30) and not both.fits_ever(31)


def test_a_step_is_chained_only_if_every_sequence_has_room_for_one_more_step():
    config = RouterConfig(max_num_batched_tokens=256, max_num_seqs=8, k_max=2)  # a step adds up to k + 1 = 3
    # block_size 1: 2 sequences of 10 tokens reserve 10 + 3 blocks each now, 10 + 6 each a step further
    for blocks, ahead in ((26, False), (31, False), (32, True)):
        sched = Scheduler(config, CacheGeometry(blocks, 1), None)
        for i in range(2):
            sched.add(make_seq(i, prompt_of(i, 10), 8))
        sched.schedule(all_k_max(config))
        assert len(sched.running) == 2 and sched.fits_ahead() is ahead, blocks


# ---- preemption and recompute --------------------------------------------------------------------------
def test_growth_preempts_the_newest_sequence_and_recompute_restores_its_output():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=4, k_max=0)
    # block_size 1, lookahead 1: a sequence of n tokens reserves n + 1 blocks
    sim = Sim(config, CacheGeometry(12, 1), None)
    old, new = make_seq(1, prompt_of(1, 4), max_tokens=4), make_seq(2, prompt_of(2, 4), max_tokens=6)
    later = make_seq(3, prompt_of(3, 1), max_tokens=2)
    sim.scheduler.add(old)
    sim.scheduler.add(new)
    sim.step()  # both prefill (5 + 5 blocks) and emit: 6 + 6 = 12 blocks
    assert sim.scheduler.running == [old, new] and old.num_output == new.num_output == 1
    sim.scheduler.add(later)  # waits: no room
    sim.step()  # both decode: 7 + 7 = 14 > 12 at the next step
    history = list(new.tokens)
    new.draft_cached = 6
    plan = sim.step()
    assert plan.preempted == [new]
    assert sim.scheduler.running == [old]
    assert list(sim.scheduler.waiting) == [new, later], "the victim goes back to the front of the queue"
    assert new.status is SeqStatus.WAITING and new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.target_cached == 0 and new.draft_cached == 0 and new.tokens == history, "caches dropped, history kept"
    assert all(s is not new for s, _ in plan.decodes) and all(c.seq is not new for c in plan.chunks)

    out = sim.run([])
    # the victim re-entered with a prefill of its whole history whose last chunk emitted the next token
    recompute = [(c.start, c.end, c.emit) for p in sim.plans for c in p.chunks if c.seq is new][1:]
    assert recompute[0][0] == 0 and recompute[-1] == (recompute[-1][0], len(history), True)
    for s in (old, new, later):
        prompt = prompt_of(s.seq_id, s.num_prompt)
        assert out[s.seq_id] == prompt + reference_continuation(prompt, s.request.max_tokens)


def test_preemption_frees_only_what_is_needed_newest_first_and_keeps_fcfs_order():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, k_max=0)
    sched = Scheduler(config, CacheGeometry(20, 1), None)
    seqs = [make_seq(i, prompt_of(i, 3), 10) for i in range(4)]  # 4 blocks each: all 4 admitted (16)
    for s in seqs:
        sched.add(s)
    sched.schedule(all_k_max(config))
    assert sched.running == seqs
    for s in seqs:  # pretend each prefilled and then grew to 6 tokens: 7 blocks each, 28 > 20
        s.tokens += [1, 2, 3]
        s.target_cached = 5
    plan = sched.schedule(all_k_max(config))
    assert plan.preempted == [seqs[3], seqs[2]], "newest first, and no more than needed (7 + 7 <= 20)"
    assert sched.running == seqs[:2]
    assert list(sched.waiting) == [seqs[2], seqs[3]], "the older victim is served first"
    assert sched.usage()[0] == 14


@pytest.mark.parametrize("chunked", [True, False])
def test_heavy_preemption_still_yields_the_reference_output(chunked):
    config = RouterConfig(max_num_batched_tokens=24, max_num_seqs=6, k_max=3, chunked_prefill=chunked)
    reqs = [(i // 2, make_seq(i, prompt_of(i, 8 + 5 * i), max_tokens=30)) for i in range(6)]
    longest = max(s.num_prompt + s.request.max_tokens for _, s in reqs)
    sim = Sim(config, CacheGeometry(-(-(longest + 4) // 4) + 2, 4), CacheGeometry(-(-(longest + 8) // 4) + 3, 4))
    out = sim.run(reqs)
    assert sum(s.num_preemptions for _, s in reqs) >= 3, "the scenario must actually preempt"
    for _, s in reqs:
        prompt = prompt_of(s.seq_id, s.num_prompt)
        assert out[s.seq_id] == prompt + reference_continuation(prompt, 30)


def test_recompute_stopping_one_short_of_the_history_resumes_as_a_decode():
    """A recompute chunk boundary may land at len - 1: the target then holds all but the last token,
    which is exactly where a decode starts, so the sequence decodes (and may speculate) from there."""
    config = RouterConfig(max_num_batched_tokens=12, max_num_seqs=2, k_max=1)
    sim = Sim(config, CacheGeometry(1000, 4), None)
    prompt = prompt_of(1, 48)
    seq = make_seq(1, prompt, max_tokens=5)
    seq.tokens += reference_continuation(prompt, 1)  # one output so far, caches lost (as after preemption)
    sim.scheduler.add(seq)
    steps = [sim.step() for _ in range(5)]
    assert [(c.start, c.end, c.emit) for p in steps[:4] for c in p.chunks] == [
        (0, 12, False), (12, 24, False), (24, 36, False), (36, 48, False)]
    assert steps[4].decodes == [(seq, 1)] and not steps[4].chunks
    sim.run([])
    assert seq.tokens == prompt + reference_continuation(prompt, 5)


# ---- priority scheduling -----------------------------------------------------------------------------
PRIORITY = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, k_max=0, scheduling_policy="priority")


def test_by_priority_the_queue_admits_the_lowest_value_first_then_by_arrival():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=1, k_max=0, scheduling_policy="priority")
    sim = Sim(config, CacheGeometry(1000, 4), None)
    seqs = [make_seq(i, prompt_of(i, 5), 3, priority=p) for i, p in enumerate((2, 1, 2, 0, 1))]
    out = sim.run([(0, s) for s in seqs])
    assert [s.seq_id for s in sim.admitted] == [3, 1, 4, 0, 2]
    assert all(out[s.seq_id] == s.tokens[:5] + reference_continuation(s.tokens[:5], 3) for s in seqs)
    fcfs = Sim(dataclasses.replace(config, scheduling_policy="fcfs"), CacheGeometry(1000, 4), None)
    fcfs.run([(0, make_seq(i, prompt_of(i, 5), 3, priority=p)) for i, p in enumerate((2, 1, 2, 0, 1))])
    assert [s.seq_id for s in fcfs.admitted] == [0, 1, 2, 3, 4], "first come, first served ignores priority"


def test_a_higher_priority_arrival_preempts_the_lowest_running_and_everyone_still_ends_exactly():
    # block_size 1, lookahead 1: a sequence of n tokens reserves n + 1 blocks; room for two of 6 + 6
    sim = Sim(PRIORITY, CacheGeometry(14, 1), None)
    low, lower = make_seq(1, prompt_of(1, 4), 6, priority=1), make_seq(2, prompt_of(2, 4), 6, priority=2)
    urgent, peer = make_seq(3, prompt_of(3, 4), 3, priority=0), make_seq(4, prompt_of(4, 4), 3, priority=1)
    sim.scheduler.add(low)
    sim.scheduler.add(lower)
    sim.step()
    assert sim.scheduler.running == [low, lower]
    sim.scheduler.add(peer)  # no room, and nobody below its priority but `lower`: it takes lower's place
    plan = sim.step()
    assert plan.preempted == [lower] and peer in sim.scheduler.running and low in sim.scheduler.running
    sim.scheduler.add(urgent)
    plan = sim.step()
    assert low not in plan.preempted or peer not in plan.preempted, "only as many as it needs"
    assert urgent in sim.scheduler.running and sim.scheduler.waiting[-1] is lower, "the lowest waits longest"
    out = sim.run([])
    for s in (low, lower, urgent, peer):
        prompt = prompt_of(s.seq_id, s.num_prompt)
        assert out[s.seq_id] == prompt + reference_continuation(prompt, s.request.max_tokens)


def test_equal_priority_never_preempts_to_be_admitted():
    sim = Sim(PRIORITY, CacheGeometry(14, 1), None)
    first, second, third = (make_seq(i, prompt_of(i, 4), 6, priority=1) for i in range(3))
    for s in (first, second):
        sim.scheduler.add(s)
    sim.step()
    sim.scheduler.add(third)
    plan = sim.step()
    assert not plan.preempted and list(sim.scheduler.waiting) == [third]


def test_growth_preempts_the_lowest_priority_not_the_newest():
    sched = Scheduler(PRIORITY, CacheGeometry(20, 1), None)
    seqs = [make_seq(i, prompt_of(i, 3), 10, priority=p) for i, p in enumerate((3, 0, 2, 1))]
    for s in seqs:  # admitted one by one: running in arrival order, not by rank
        sched.add(s)
        sched.schedule(all_k_max(PRIORITY))
    assert sched.running == seqs
    for s in seqs:  # grown to 6 tokens: 7 blocks each, 28 > 20
        s.tokens += [1, 2, 3]
        s.target_cached = 5
    plan = sched.schedule(all_k_max(PRIORITY))
    assert plan.preempted == [seqs[0], seqs[2]] and list(sched.waiting) == [seqs[2], seqs[0]]


def test_by_priority_the_budget_goes_to_the_higher_prompt_first():
    config = dataclasses.replace(PRIORITY, max_num_batched_tokens=16)
    sched = Scheduler(config, CacheGeometry(1000, 4), None)
    low, high = make_seq(1, prompt_of(1, 40), 4, priority=1), make_seq(2, prompt_of(2, 40), 4, priority=0)
    sched.add(low)
    sched.add(high)
    sched.running = [low, high]  # (as if both had been admitted, low first)
    for seq in (low, high):
        seq.status = SeqStatus.RUNNING
    sched.waiting.clear()
    plan = sched.schedule(all_k_max(config))
    assert [(c.seq, c.end - c.start) for c in plan.chunks] == [(high, 16)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads, priorities=st.lists(st.integers(0, 2), min_size=8, max_size=8))
def test_by_priority_any_workload_keeps_invariants_rank_order_and_the_reference_output(w, priorities):
    """Whatever the priorities: the step invariants, every sequence ends exactly as plain greedy
    decoding, and every step admits only sequences that rank ahead of all it leaves waiting."""
    config = RouterConfig(max_num_batched_tokens=w["budget"], max_num_seqs=min(w["max_num_seqs"], w["budget"]),
                          k_max=w["k_max"], chunked_prefill=w["chunked"], scheduling_policy="priority")
    bs, la = w["block_size"], w["k_max"] + 1
    longest = max(p + m for _, p, m in w["requests"])
    target = CacheGeometry(-(-(longest + la) // bs) + w["slack_t"], bs)
    draft = CacheGeometry(-(-(longest + 2 * la) // bs) + w["slack_d"], bs) if w["with_draft"] else None
    sim = Sim(config, target, draft, wild_ks if w["wild_k"] else None)
    out = sim.run([(at, make_seq(i, prompt_of(i, p), m, priorities[i])) for i, (at, p, m) in enumerate(w["requests"])])
    for i, (_, p, m) in enumerate(w["requests"]):
        prompt = prompt_of(i, p)
        assert out[i] == prompt + reference_continuation(prompt, m)
    for admitted, left in sim.rounds:
        if admitted and left:
            assert max(map(Scheduler.rank, admitted)) < min(map(Scheduler.rank, left))
