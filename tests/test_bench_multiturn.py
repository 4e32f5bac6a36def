"""The multi-turn bench workload: conversations fit the model's context, are the same on every run,
and a run whose two modes answered differently fails."""

from __future__ import annotations

from tokenizers import Tokenizer

from bench.multiturn import ModeResult, Turn, report, script, shape_for


def test_the_last_turn_fits_the_context_and_the_script_is_deterministic(model_pair):
    target_dir, _ = model_pair
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    for max_len, quick in ((512, False), (512, True), (2048, False)):
        shape = shape_for(max_len, quick)
        worst = shape.system_tokens + shape.turns * (shape.user_tokens + shape.reply_tokens + 16)
        assert worst <= 0.9 * max_len and shape.budget == max_len // 8
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

    text, ok = report([mode("prefix caching", "a", 0.02), mode("no prefix caching", "a", 0.1)], shape)
    assert ok and "PASS  TTFT p50 ratio 0.20" in text
    text, ok = report([mode("prefix caching", "a", 0.05), mode("no prefix caching", "b", 0.1)], shape)
    assert not ok and "FAIL  answers identical" in text and "FAIL  TTFT p50 ratio 0.50" in text
