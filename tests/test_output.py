"""OutputBuilder specification, with a real byte-level BPE tokenizer: what a client sees of the
tokens the target emits -- incremental text, stop strings (matched across token boundaries, cut
from the text, never partly streamed), EOS, max_tokens, and UTF-8 held back until complete."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from router.core import GREEDY, Delta, FinishReason, Request, TokenLogprob
from router.output import OutputBuilder
from tests.conftest import write_tokenizer

EOS = 1  # "</s>" in write_tokenizer's vocabulary
SAMPLE = ('def wrap(text, width=70, **kwargs):\n    """Wrap a single paragraph of text -- naïve café '
          '\u00fcber 😀 \u4e2d\u6587."""\n    w = TextWrapper(width=width, **kwargs)\n    return w.wrap(text)\n')


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def builder(tok: Tokenizer, stop: tuple[str, ...] = (), max_tokens: int = 1000, ignore_eos: bool = False):
    req = Request("r", prompt_ids=[5, 6, 7], sampling=GREEDY, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos)
    return OutputBuilder(tok, req, {EOS}, max_tokens)


def feed(b: OutputBuilder, groups: list[list[int]]) -> tuple[list[int], list[Delta]]:
    """Emit each group as one step's tokens until the builder finishes: (tokens kept, deltas sent)."""
    kept, deltas = [], []
    for g in groups:
        k, delta = b.add(g, None)
        kept += k
        if delta is not None:
            deltas.append(delta)
        if b.finish_reason is not None:
            break
    return kept, deltas


def streamed(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def reference(tok: Tokenizer, ids: list[int], stop: tuple[str, ...], max_tokens: int, ignore_eos: bool = False):
    """Non-incremental statement of the rules: (tokens kept, final text, finish reason)."""
    out: list[int] = []
    for t in ids:
        if t == EOS and not ignore_eos:
            return out, tok.decode(out), FinishReason.STOP  # EOS ends the output and is not part of it
        out.append(t)
        text = tok.decode(out)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return out, text[: min(hits)], FinishReason.STOP  # cut at the earliest match
        if len(out) >= max_tokens:
            return out, text, FinishReason.LENGTH
    return out, tok.decode(out), None


def spans_tokens(tok: Tokenizer, ids: list[int], s: str) -> int:
    """How many tokens the first occurrence of s in decode(ids) touches."""
    text = tok.decode(ids)
    i = text.index(s)
    starts = [len(tok.decode(ids[:j])) for j in range(len(ids) + 1)]
    first = max(j for j in range(len(ids)) if starts[j] <= i)
    last = min(j for j in range(1, len(ids) + 1) if starts[j] >= i + len(s))
    return last - first


# ---- stop strings -----------------------------------------------------------------------------------
def test_stop_string_across_token_boundaries_is_matched_and_cut(tok):
    ids = tok.encode("def hello(world):\n    return world\n").ids
    assert spans_tokens(tok, ids, "(wor") >= 2, "the case must actually span tokens"
    b = builder(tok, stop=("(wor",))
    kept, deltas = feed(b, [[t] for t in ids])
    assert streamed(deltas) == "def hello"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert tok.decode(kept).startswith("def hello(wor") and not tok.decode(kept[:-1]).startswith("def hello(wor"), \
        "tokens are kept up to the one completing the stop string, none after"
    assert [t for d in deltas for t in d.token_ids] == kept
    assert deltas[-1].completion_tokens == len(kept)


def test_stop_string_in_one_step_of_many_tokens_drops_the_rest(tok):
    ids = tok.encode("def hello(world):\n    return world\n").ids
    b = builder(tok, stop=("(wor",))
    kept, delta = b.add(ids, None)
    assert delta.text == "def hello" and delta.finish_reason is FinishReason.STOP
    assert kept == ids[: len(kept)] and len(kept) < len(ids)
    assert "(wor" in tok.decode(kept) and "(wor" not in tok.decode(kept[:-1])


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("def hello(world):\n").ids
    _, deltas = feed(builder(tok, stop=("world", "hello")), [[t] for t in ids])
    assert streamed(deltas) == "def "
    # a shorter string completing first cuts even where a longer one started earlier
    _, deltas = feed(builder(tok, stop=("hello(world", "lo(")), [[t] for t in ids])
    assert streamed(deltas) == "def hel"
    assert deltas[-1].stop_reason == "lo(", "the one that matched is named (vLLM's stop_reason)"
    b = builder(tok, stop=("hello(world", "lo("))
    b.request = replace(b.request, include_stop_str_in_output=True)
    _, deltas = feed(b, [[t] for t in ids])
    assert streamed(deltas) == "def hello(", "include_stop_str_in_output keeps the string that matched, no more"


def test_a_possible_stop_prefix_is_held_back_then_released_when_it_does_not_match(tok):
    ids = tok.encode("def hello(world):").ids
    j = next(j for j in range(1, len(ids) + 1) if tok.decode(ids[:j]).endswith("("))
    b = builder(tok, stop=("(x",))
    _, first = feed(b, [[t] for t in ids[:j]])
    assert streamed(first) == "def hello", "'(' could begin '(x': not sent yet"
    _, d = b.add([ids[j]], None)
    assert tok.decode(ids[: j + 1]).startswith("def hello(w")
    assert streamed([*first, d]) == tok.decode(ids[: j + 1])[:-1], "'(' released; the newest char is held in turn"
    _, rest = feed(b, [[t] for t in ids[j + 1:]] + [[EOS]])
    assert streamed([*first, d, *rest]) == "def hello(world):"
    assert rest[-1].finish_reason is FinishReason.STOP
    _, deltas = feed(builder(tok, stop=("(x",), max_tokens=len(ids)), [[t] for t in ids])
    assert streamed(deltas) == "def hello(world):" and deltas[-1].finish_reason is FinishReason.LENGTH


def test_a_stop_string_ending_in_a_multibyte_character_never_leaks(tok):
    """While the emoji's bytes arrive, "er " + an incomplete character could still become "er 😀":
    none of it may be streamed (the incomplete character does not count toward the hold-back)."""
    text = "über 😀 x"
    ids = tok.encode(text).ids
    assert any(tok.decode(ids[:j]).endswith("er \ufffd") for j in range(len(ids)))
    b = builder(tok, stop=("er 😀",))
    _, deltas = feed(b, [[t] for t in ids])
    for j in range(1, len(deltas) + 1):
        assert "üb".startswith(streamed(deltas[:j]))
    assert streamed(deltas) == "üb" and deltas[-1].finish_reason is FinishReason.STOP


# ---- EOS and max_tokens ------------------------------------------------------------------------------
def test_eos_finishes_with_stop_and_is_not_part_of_the_output(tok):
    ids = tok.encode("hello world").ids
    b = builder(tok)
    kept, delta = b.add([*ids, EOS, *ids], None)
    assert kept == ids
    assert delta.finish_reason is FinishReason.STOP and EOS not in delta.token_ids
    assert delta.text == "hello world"
    assert delta.completion_tokens == len(ids)
    assert delta.stop_reason is None, "EOS is no stop string or stop token"


def test_a_stop_token_is_named_as_the_stop_reason_unless_it_is_eos(tok):
    ids = tok.encode("hello world").ids
    req = Request("r", prompt_ids=[5], sampling=replace(GREEDY, stop_token_ids=(ids[1], EOS)), max_tokens=50)
    _, delta = OutputBuilder(tok, req, {EOS}, 50).add(ids, None)
    assert delta.finish_reason is FinishReason.STOP and delta.stop_reason == ids[1] and delta.token_ids == ids[:1]
    _, delta = OutputBuilder(tok, req, {EOS}, 50).add([ids[0], EOS], None)
    assert delta.finish_reason is FinishReason.STOP and delta.stop_reason is None
    kept = replace(req, include_stop_str_in_output=True)
    taken, delta = OutputBuilder(tok, kept, {EOS}, 50).add(ids, None)
    assert taken == delta.token_ids == ids[:2] and delta.text == tok.decode(ids[:2]) and delta.stop_reason == ids[1]
    taken, delta = OutputBuilder(tok, kept, {EOS}, 50).add([ids[0], EOS], None)
    assert taken == [ids[0]] and delta.stop_reason is None, "EOS never joins the output"


def test_eos_alone_in_a_later_step(tok):
    ids = tok.encode("hello world").ids
    b = builder(tok)
    kept, deltas = feed(b, [ids, [EOS]])
    assert kept == ids and streamed(deltas) == "hello world"
    assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].token_ids == []


def test_ignore_eos_treats_eos_as_an_ordinary_token(tok):
    ids = tok.encode("hello").ids
    b = builder(tok, ignore_eos=True)
    kept, delta = b.add([*ids, EOS, *ids], None)
    assert kept == [*ids, EOS, *ids] and b.finish_reason is None
    assert delta.text == "hellohello"  # the special token decodes to nothing


def test_max_tokens_finishes_with_length_and_drops_surplus_tokens_of_the_same_step(tok):
    ids = tok.encode("def hello(world):\n    return world\n").ids
    b = builder(tok, max_tokens=5)
    lps = [TokenLogprob(t, -0.5, []) for t in ids[:8]]
    kept, delta = b.add(ids[:8], lps)  # a verification emitted 8 tokens; only 5 were allowed
    assert kept == ids[:5]
    assert delta.finish_reason is FinishReason.LENGTH
    assert delta.token_ids == ids[:5] and delta.completion_tokens == 5
    assert delta.text == tok.decode(ids[:5])
    assert [lp.token_id for lp in delta.logprobs] == ids[:5]


def test_max_tokens_reached_over_several_steps(tok):
    ids = tok.encode("def hello(world):\n    return world\n").ids
    kept, deltas = feed(builder(tok, max_tokens=7), [ids[0:3], ids[3:5], ids[5:9], ids[9:]])
    assert kept == ids[:7]
    assert streamed(deltas) == tok.decode(ids[:7])
    assert [d.finish_reason for d in deltas] == [None, None, FinishReason.LENGTH]


# ---- UTF-8 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [(), ("zzz",)], ids=["no-stop", "with-holdback"])
def test_incomplete_utf8_is_held_back_until_its_last_byte(tok, stop):
    text = "a é😀 \u4e2d!"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode(ids[:j]) for j in range(len(ids))), "the case must split a character"
    b = builder(tok, stop=stop)
    _, deltas = feed(b, [[t] for t in ids])
    assert len(deltas) == len(ids)
    for j, d in enumerate(deltas, start=1):  # after ids[:j]
        so_far = streamed(deltas[:j])
        assert "\ufffd" not in d.text and text.startswith(so_far)
        if not stop:  # nothing held back but the incomplete character
            assert so_far == tok.decode(ids[:j]).rstrip("\ufffd")
    _, final = b.add([EOS], None)
    assert streamed([*deltas, final]) == text


# ---- the whole contract, on arbitrary splits -------------------------------------------------------------
def _splits(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_final_text_and_never_leaks_a_stop_string(tok, data):
    lo = data.draw(st.integers(0, len(SAMPLE) - 1))
    hi = data.draw(st.integers(lo + 1, min(len(SAMPLE), lo + 60)))
    text = SAMPLE[lo:hi]
    ids = tok.encode(text).ids
    if data.draw(st.booleans()):
        ids = ids[:] + [EOS] + ids[:3]
    subs = st.builds(lambda i, n: text[i:i + n], st.integers(0, len(text) - 1), st.integers(1, 6))
    stop = tuple(data.draw(st.lists(st.one_of(subs, st.sampled_from(["zz", "(", "é", "😀 ", ",\n"])),
                                    max_size=3)))
    max_tokens = data.draw(st.integers(1, len(ids) + 2))
    groups = _splits(ids, data.draw(st.lists(st.integers(0, 200), max_size=8)))

    b = OutputBuilder(tok, Request("r", [5], GREEDY, max_tokens=max_tokens, stop=stop), {EOS}, max_tokens)
    kept, deltas = feed(b, groups)
    want_kept, want_text, want_reason = reference(tok, ids, stop, max_tokens)

    assert kept == want_kept
    assert [t for d in deltas for t in d.token_ids] == want_kept
    sent = ""
    for d in deltas[:-1] if want_reason else deltas:
        sent += d.text
        assert want_text.startswith(sent), "a streamed piece was later cut (a stop-string prefix leaked)"
        assert d.finish_reason is None
    if want_reason is not None:
        assert deltas[-1].finish_reason is want_reason
        assert streamed(deltas) == want_text
        assert deltas[-1].completion_tokens == len(want_kept)
    else:
        assert b.finish_reason is None
        assert want_text.startswith(streamed(deltas))


# ---- cost -------------------------------------------------------------------------------------------------
def test_a_long_answer_costs_linear_work(tok):
    """4,000 tokens one per step with stop strings set: every character is scanned for stop strings a
    bounded number of times (the old builder re-decoded the whole output each step: ~n^2/2)."""
    import sysconfig
    from pathlib import Path

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tok.encode(text).ids[:4000]
    assert len(ids) == 4000
    stop = ("\x00never", "zq")
    b = builder(tok, stop=stop, max_tokens=4000)
    kept, deltas = feed(b, [[t] for t in ids])
    assert kept == ids and deltas[-1].finish_reason is FinishReason.LENGTH
    assert streamed(deltas) == tok.decode(ids)
    holdback = max(len(s) for s in stop) - 1
    assert b.chars_scanned <= len(streamed(deltas)) + holdback * len(ids)
