"""Prefix caching in the scheduler, without services: the fake model of tests/test_scheduler.py on a
real prefix-caching block manager (engine/kv_cache.py). Each slot holds the model's state after its
prefix, so a sequence that attached blocks holding anything but its own history would emit wrong
tokens: every conversation must end exactly as plain greedy decoding, whatever is cached, evicted or
lost, and the service must never run out of blocks the router promised."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockManager
from engine.prefix_cache import PrefixCache
from router.config import RouterConfig
from router.core import SeqStatus
from router.metrics import Metrics
from router.prefix import PrefixCaches
from router.scheduler import CacheGeometry, Scheduler, StepPlan
from router.sequence import Sequence
from tests.test_scheduler import VOCAB, _greedy, _state, all_k_max, fake_draft, make_seq, reference_continuation


class CacheMiss(Exception):
    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(seq_ids)
        self.seq_ids = seq_ids


class CachingTarget:
    def __init__(self, geometry: CacheGeometry) -> None:
        self.blocks = BlockManager(geometry.num_blocks, geometry.block_size)
        self.ledger = PrefixCache(self.blocks)
        self.state: dict[int, int] = {}  # slot -> the model's state after the prefix ending there

    def _slot(self, seq_id: int, pos: int) -> int:
        bs = self.blocks.block_size
        return self.blocks.block_table(seq_id)[pos // bs] * bs + pos % bs

    def step(self, plan: StepPlan) -> dict[int, tuple[list[int], int]]:
        entries = [(s, len(s.tokens) - 1, [s.tokens[-1], *fake_draft(s.tokens, k)], k, True, ())
                   for s, k in plan.decodes]
        entries += [(c.seq, c.start, c.seq.tokens[c.start:c.end], 0, c.emit, c.attach) for c in plan.chunks]
        missing = [s.seq_id for s, start, _, _, _, attach in entries
                   if not (self.ledger.holds(attach) if attach else start <= self.blocks.length(s.seq_id))]
        if missing:
            raise CacheMiss(missing)
        # the router's reservations must make room: an exhausted cache fails the test here
        self.blocks.check_capacity({s.seq_id: (start, start + len(t)) for s, start, t, *_ in entries},
                                   attach={s.seq_id: a for s, *_, a in entries if a})
        for s, *_, attach in entries:
            if attach:
                self.ledger.attach(s.seq_id, attach)
        for s, start, *_ in entries:
            self.blocks.trim(s.seq_id, start)
            self.ledger.trim(s.seq_id, start)
        results = {}
        for s, start, tokens, k, emit, _ in entries:
            self.blocks.append(s.seq_id, len(tokens))
            self.ledger.extend(s.seq_id, tokens)
            for src, dst in self.blocks.take_copies():
                for o in range(self.blocks.block_size):
                    self.state[dst * self.blocks.block_size + o] = self.state.get(src * self.blocks.block_size + o, 0)
            prev = self.state[self._slot(s.seq_id, start - 1)] if start else 0
            states = []
            for p, t in enumerate(tokens, start):
                prev = self.state[self._slot(s.seq_id, p)] = _state(prev, t)
                states.append(prev)
            emitted = []
            for i in range(k + 1 if emit else 0):
                emitted.append(_greedy(states[len(tokens) - k - 1 + i]))
                if i == k or tokens[len(tokens) - k + i] != emitted[-1]:
                    break
            cached = start + len(tokens) - k + max(0, len(emitted) - 1)
            results[s.seq_id] = (emitted, cached)
        for seq_id, (_, cached) in results.items():
            self.blocks.trim(seq_id, cached)
            self.ledger.trim(seq_id, cached)
            self.ledger.commit(seq_id, cached)
        return results

    def release(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self.ledger.free(seq_id)


class ChatSim:
    """Conversations in a closed loop: each turn resends the history plus new user tokens once the
    previous turn finished. The router side applies results and cache misses as router/loop.py does."""

    def __init__(self, config: RouterConfig, target: CacheGeometry, caching: bool = True) -> None:
        self.metrics = Metrics(config.k_max)
        m = self.metrics
        prefix = PrefixCaches(target.block_size, m.prefix_queries, m.prefix_hits, m.prefix_misses) if caching else None
        self.scheduler = Scheduler(config, target, None, prefix=prefix)
        self.geometry = target
        self.service = CachingTarget(target)
        self.plans: list[StepPlan] = []
        self.ids = itertools.count()
        self.misses = 0

    def counter(self, c) -> float:  # noqa: ANN001
        return c.labels(service="target")._value.get()

    def restart_service(self) -> None:
        self.service = CachingTarget(self.geometry)

    def step(self) -> list[Sequence]:
        plan = self.scheduler.schedule(all_k_max(self.scheduler.config))
        t, _ = self.scheduler.usage()
        assert t <= self.geometry.num_blocks
        for seq in plan.preempted:
            self.service.release(seq.seq_id)
        self.plans.append(plan)
        try:
            results = self.service.step(plan)
        except CacheMiss as miss:
            self.misses += 1
            for seq in self.scheduler.running:
                if seq.seq_id in miss.seq_ids:
                    seq.target_cached = 0
            return []
        done = []
        for seq in [s for s, _ in plan.decodes] + [c.seq for c in plan.chunks]:
            emitted, cached = results[seq.seq_id]
            seq.target_cached = cached
            seq.tokens.extend(emitted[:seq.request.max_tokens - seq.num_output])
            if seq.num_output >= seq.request.max_tokens:
                seq.finished, seq.status = True, SeqStatus.FINISHED
                self.scheduler.remove(seq)
                self.service.release(seq.seq_id)
                done.append(seq)
        return done

    def chat(self, conversations: list[list[tuple[list[int], int]]], restart_at: int = -1) -> list[list[Sequence]]:
        """conversations: per conversation, its turns as (new user tokens, max_tokens). Returns the turns' sequences."""
        turns: list[list[Sequence]] = [[] for _ in conversations]

        def next_turn(c: int) -> None:
            history = turns[c][-1].tokens if turns[c] else []
            user, max_tokens = conversations[c][len(turns[c])]
            turns[c].append(make_seq(next(self.ids), history + user, max_tokens))
            self.scheduler.add(turns[c][-1])

        for c in range(len(conversations)):
            next_turn(c)
        for t in itertools.count():
            assert t < 5000, "no progress"
            if t == restart_at:
                self.restart_service()
            for seq in self.step():
                c = next(i for i, ts in enumerate(turns) if ts[-1] is seq)
                if len(turns[c]) < len(conversations[c]):
                    next_turn(c)
            if not self.scheduler.running and not self.scheduler.waiting:
                return turns


def assert_reference(turns: list[list[Sequence]]) -> None:
    for conv in turns:
        for seq in conv:
            prompt = seq.tokens[:seq.num_prompt]
            assert seq.tokens == prompt + reference_continuation(prompt, seq.request.max_tokens)


SYSTEM = [(5 * i + 3) % VOCAB for i in range(40)]


def test_a_later_turn_prefills_only_what_follows_its_cached_history():
    sim = ChatSim(RouterConfig(max_num_batched_tokens=64, max_num_seqs=4, k_max=2), CacheGeometry(100, 4))
    turns = sim.chat([[(SYSTEM, 8), ([11, 12, 13, 14, 15], 4)]])
    first, second = turns[0]
    chunks = [(c.start, c.end, c.attach) for p in sim.plans for c in p.chunks if c.seq is second]
    # turn 1 ended with 47 tokens cached (the last emitted one never is): 11 full blocks published
    assert len(chunks) == 1 and chunks[0][:2] == (44, 53) and len(chunks[0][2]) == 11
    assert sim.counter(sim.metrics.prefix_hits) == 44
    assert sim.counter(sim.metrics.prefix_queries) == 40 + 53
    assert_reference(turns)


def test_a_shared_system_prompt_is_reserved_once():
    config = RouterConfig(max_num_batched_tokens=256, max_num_seqs=8, k_max=0)
    sim = ChatSim(config, CacheGeometry(200, 4))
    sim.chat([[(SYSTEM, 1)]])  # publishes the system prompt's 10 full blocks
    seqs = [make_seq(100 + i, SYSTEM + [i + 1] * 6, 3) for i in range(4)]
    for s in seqs:
        sim.scheduler.add(s)
    sim.step()
    private = sum(sim.geometry.blocks(len(s.tokens) + 1) - 10 for s in seqs)
    assert sim.scheduler.usage()[0] == private + 10, "the attached 10 blocks count once for the 4 sequences"
    assert all(s.target_cached == len(s.tokens) - 1 for s in seqs)


def test_a_refused_attach_is_recomputed_and_never_tried_again():
    sim = ChatSim(RouterConfig(max_num_batched_tokens=64, max_num_seqs=4, k_max=1), CacheGeometry(100, 4))
    sim.chat([[(SYSTEM, 2)]])
    sim.restart_service()  # the router still believes the system prompt is cached
    turns = sim.chat([[(SYSTEM + [9, 9, 9], 3)]])
    assert sim.misses == 1 and sim.counter(sim.metrics.prefix_misses) == 1
    starts = [(c.start, bool(c.attach)) for p in sim.plans for c in p.chunks if c.seq is turns[0][0]]
    assert starts == [(40, True), (0, False)], "one refused attach, then a recompute from 0"
    assert_reference(turns)


def test_a_preempted_sequence_recomputes_from_its_own_released_blocks():
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=4, k_max=0)
    sim = ChatSim(config, CacheGeometry(24, 4))
    turns = sim.chat([[(SYSTEM, 30)], [(SYSTEM[:8] + [1], 30)]])
    preempted = [s for conv in turns for s in conv if s.num_preemptions]
    assert preempted, "the scenario must preempt"
    for seq in preempted:
        restarts = [c for p in sim.plans for c in p.chunks if c.seq is seq][1:]
        assert any(c.attach and c.start > 0 for c in restarts), "the recompute attached what it had computed"
    assert_reference(turns)


conversations = st.lists(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), min_size=1, max_size=4),
                         min_size=1, max_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convs=conversations, system=st.integers(0, 30), budget=st.integers(8, 48), k_max=st.integers(0, 3),
       block_size=st.sampled_from([1, 2, 4, 8]), slack=st.integers(0, 30), restart_at=st.integers(-1, 60))
def test_any_chat_workload_ends_as_greedy_decoding_with_and_without_caching(convs, system, budget, k_max,
                                                                           block_size, slack, restart_at):
    config = RouterConfig(max_num_batched_tokens=budget, max_num_seqs=4, k_max=k_max)
    script = [[([(7 * c + 13 * t + j) % VOCAB for j in range(n + (system if t == 0 else 0))], m)
               for t, (n, m) in enumerate(turns)] for c, turns in enumerate(convs)]
    for turns in script:  # conversations share the system prompt
        turns[0] = (SYSTEM[:system] + turns[0][0][system:], turns[0][1])
    longest = max(sum(len(u) + m for u, m in turns) for turns in script)
    geometry = CacheGeometry(-(-(longest + k_max + 1) // block_size) + slack, block_size)
    cached = ChatSim(config, geometry)
    with_caching = cached.chat(script, restart_at)
    without = ChatSim(config, geometry, caching=False).chat(script)
    assert_reference(with_caching)
    assert [[s.tokens for s in conv] for conv in with_caching] == [[s.tokens for s in conv] for conv in without]
    hits, queries = cached.counter(cached.metrics.prefix_hits), cached.counter(cached.metrics.prefix_queries)
    assert 0 <= hits <= queries
    event(f"attached: {hits > 0}")  # --hypothesis-show-statistics: how often each case was exercised
    event(f"refused attach: {cached.counter(cached.metrics.prefix_misses) > 0}")
    event(f"preempted: {any(s.num_preemptions for conv in with_caching for s in conv)}")
