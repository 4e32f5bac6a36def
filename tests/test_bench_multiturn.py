"""The multi-turn bench workload: conversations fit the model's context, are the same on every run,
and a run whose two modes answered differently fails."""

from __future__ import annotations

from tokenizers import Tokenizer

from bench.conversations import Turn, script, shape_for
from bench.multiturn import ModeResult, first_differences, judged_differences, report


def test_the_last_turn_fits_the_context_and_the_script_is_deterministic(model_pair):
    target_dir, _ = model_pair
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    for max_len, quick in ((512, False), (512, True), (2048, False)):
        shape = shape_for(max_len, quick)
        worst = shape.system_tokens + shape.turns * (shape.user_tokens + shape.reply_tokens + 32)
        assert worst <= 0.8 * max_len and shape.budget == max_len // 8
    assert shape_for(8192, quick=False) == shape_for(2048, quick=False)  # a long context is not filled
    shape = shape_for(512, quick=True)
    system, convs = script(tok, shape, seed=0)
    assert (system, convs) == script(tok, shape, seed=0) and script(tok, shape, seed=1)[1] != convs
    assert len(convs) == shape.conversations and all(len(c) == shape.turns for c in convs)
    assert len(tok.encode(system).ids) <= shape.system_tokens + 2
    assert all(len(tok.encode(q).ids) <= shape.user_tokens + 2 for c in convs for q in c)


def test_the_report_fails_a_run_whose_answers_differ():
    shape = shape_for(512, quick=True)

    def mode(name: str, answer: str, ttft: float) -> ModeResult:
        turns = [Turn(0, 1, ttft, 1.0, answer), Turn(0, 2, ttft, 1.0, answer)]
        return ModeResult(name, ttft, ttft, 100.0, 0.5, {"target": 0.5, "draft": 0.5}, 0, turns)

    text, ok = report([mode("prefix caching", "a", 0.02), mode("no prefix caching", "a", 0.1)], shape, [])
    assert ok and "PASS  TTFT p50 ratio 0.20" in text
    on, off = mode("prefix caching", "a", 0.05), mode("no prefix caching", "b", 0.1)
    diffs = first_differences(on.turns, off.turns)
    text, ok = report([on, off], shape, diffs)
    assert not ok and "FAIL  answers DIFFERENT" in text and "FAIL  TTFT p50 ratio 0.50" in text
    assert "conversation 0, turn 1, character 0: with 'a', without 'b'" in text
    words = "near-tie (float64 logits 0.0e+00 and 2.0e-07 below the best)"
    tie = [{**diffs[0], "verdict": {"tie": True, "text": words}}]
    text, ok = report([on, off], shape, tie)
    assert ok and "PASS  answers identical but where they first differ at a float64 near-tie" in text
    assert "turn 1, character 0: near-tie (float64 logits" in text


def test_a_difference_is_judged_at_the_turn_s_prompt_as_the_router_renders_it(model_pair):
    """Two answers that differ in their second token: the verdict scores the reference after the
    rendered prompt and the first token, and says how far below the best logit each token is."""
    target_dir, _ = model_pair
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    shape = shape_for(512, quick=True)
    first = tok.decode([40, 41])
    on = [Turn(0, 1, 0, 0, first), Turn(0, 2, 0, 0, "same")]
    off = [Turn(0, 1, 0, 0, first), Turn(0, 2, 0, 0, "other")]
    (d,) = judged_differences(target_dir.parent, shape, 0, on, off)
    assert d["turn"] == 2 and d["verdict"]["text"].split(" ")[0] in ("near-tie", "MISMATCH")
    assert all(gap >= 0 for gap in d["verdict"]["below_best"])


def test_a_difference_is_located_at_its_first_turn_and_character_per_conversation():
    on = [Turn(0, 1, 0, 0, "same"), Turn(0, 2, 0, 0, "x" * 50 + "cat"), Turn(0, 3, 0, 0, "later"),
          Turn(1, 1, 0, 0, "ok"), Turn(1, 2, 0, 0, "ok")]
    off = [Turn(0, 1, 0, 0, "same"), Turn(0, 2, 0, 0, "x" * 50 + "dog"), Turn(0, 3, 0, 0, "differs too"),
           Turn(1, 1, 0, 0, "ok"), Turn(1, 2, 0, 0, "ok")]
    assert first_differences(on, off, context=4) == [
        {"conversation": 0, "turn": 2, "at_char": 50, "with": "xxxxcat", "without": "xxxxdog"}]
    assert first_differences(on[3:], off[3:]) == []
    assert first_differences([Turn(0, 1, 0, 0, "ab")], [Turn(0, 1, 0, 0, "abc")])[0]["at_char"] == 2


def test_the_last_turn_as_the_router_renders_it_leaves_room_for_its_answer(model_pair):
    """Worst case of the served path: every answer is reply_tokens arbitrary tokens, decoded, then
    rendered with the whole history by the router's own chat formatting and encoded again."""
    import random

    from router.chat import ChatFormatter

    target_dir, _ = model_pair
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    chat = ChatFormatter.from_dir(target_dir)
    for quick in (True, False):
        shape = shape_for(512, quick)
        system, convs = script(tok, shape, seed=0)
        rng = random.Random(0)
        for questions in convs:
            messages = [("system", system)]
            for question in questions:
                messages.append(("user", question))
                if len(messages) < 2 * shape.turns + 1:
                    answer = tok.decode([rng.randrange(tok.get_vocab_size()) for _ in range(shape.reply_tokens)])
                    messages.append(("assistant", answer))
            assert len(tok.encode(chat.render(messages)).ids) + shape.reply_tokens <= 512


def test_the_printed_report_says_n_a_where_a_service_had_no_queries():
    shape = shape_for(512, quick=True)
    turns = [Turn(0, 1, 0.02, 1.0, "a")]
    nan = float("nan")
    on = ModeResult("prefix caching", 0.02, 0.02, 100.0, 0.5, {"target": 0.75, "draft": nan}, 0, turns)
    off = ModeResult("no prefix caching", 0.1, 0.1, 100.0, 0.5, {"target": nan, "draft": nan}, 0, turns)
    text, _ = report([on, off], shape, [])
    assert "nan" not in text
    on_row = next(line for line in text.splitlines() if line.startswith("prefix caching"))
    assert on_row.split()[-3:] == ["0.75", "n/a", "0"]
