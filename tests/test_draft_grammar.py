"""The draft under a grammar, without gRPC: every draft it makes, on the plain continuation and on
every branch of the speculation cache, is one the grammar allows, and the q it ships has no mass
outside the mask (so the target's rejection sampling on (p', q') is exact)."""

from __future__ import annotations

import pytest

from common.grammar import Matcher, compile_grammar, load_tokenizer
from draft_service.drafts import BranchSpec, DraftRequest
from draft_service.proposer import Proposer
from engine import EngineConfig, ModelRunner
from engine.sampling import SamplingSpec
from tests.test_structured import SCHEMA

EOS = 1


@pytest.fixture(scope="module")
def setup(model_pair):
    draft_dir = model_pair[1]
    runner = ModelRunner.load(draft_dir, EngineConfig(num_blocks=256, block_size=4, device="cpu"))
    tok = load_tokenizer(str(draft_dir / "tokenizer.json"), runner.model_config.vocab_size, (EOS,))
    # a schema's opening is fixed (few outcomes to branch on); a regex leaves every position open
    return runner, tok, {"json": compile_grammar("json_schema", SCHEMA, tok),
                         "regex": compile_grammar("regex", "[a-z_ ]{6,40}", tok)}


def check_valid(tok, grammar: str, output: list[int], qs=()) -> None:  # noqa: ANN001
    """Each token allowed where it stands (an EOS ends the check), each q inside the mask it was drawn under."""
    m = Matcher(tok, grammar)
    qs = list(qs)
    for i, t in enumerate(output):
        mask = m.mask()
        if i >= len(output) - len(qs):
            q = qs[i - (len(output) - len(qs))]
            assert all(Matcher.allowed(mask, x) for x, p in zip(q.token_ids, q.probs, strict=True) if p > 0)
        assert Matcher.allowed(mask, t), f"token {t} at output position {i} is outside the grammar"
        if t == EOS:
            return
        assert m.consume(t)


@pytest.mark.parametrize("spec", [SamplingSpec(), SamplingSpec(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["json", "regex"])
def test_plain_and_branch_drafts_stay_inside_the_grammar(setup, spec, kind):
    runner, tok, grammars = setup
    grammar = grammars[kind]
    proposer = Proposer(runner, eos_ids=[EOS])
    prompt = [0, 40, 41, 42, 43, 44]
    p = len(prompt)
    first = proposer.propose([DraftRequest(7, 0, prompt, 4, spec, grammar=grammar, prompt_len=p)]).results[0]
    drafts = first.plain.drafts
    check_valid(tok, grammar, drafts, first.plain.probs)
    # the target accepted d1 and is verifying d2..d4: branches for every outcome, the draft's top two guesses
    branches = [BranchSpec(j, r) for j in range(4) for r in (1, 2)]
    out = proposer.propose([DraftRequest(7, p, drafts, 3, spec, num_verifying=3, branches=branches,
                                         prompt_len=p)]).results[0]
    assert len(out.branches) == len(branches)
    checked = 0
    for b in out.branches:
        fork = Matcher(tok, grammar)
        assert fork.sync(drafts[:1 + b.accepted])
        if not Matcher.allowed(fork.mask(), b.token):
            continue  # an outcome that cannot happen (the rejected draft was the only allowed token): never used
        check_valid(tok, grammar, drafts[:1 + b.accepted] + [b.token] + b.drafts, b.probs)
        checked += 1
    assert checked >= (6 if kind == "regex" else 1)
    runner.release([7])
    proposer.constraints.release([7])


def test_a_forked_choice_inherits_the_grammar_state(setup):
    runner, tok, grammars = setup
    grammar = grammars["json"]
    proposer = Proposer(runner, eos_ids=[EOS])
    prompt = [0, 50, 51, 52, 53]
    proposer.propose([DraftRequest(8, 0, prompt, 0, grammar=grammar, prompt_len=len(prompt))])
    first = [tok.tokenize_str('{"')[0]]
    out = proposer.propose([DraftRequest(9, len(prompt), first, 3, prompt_len=len(prompt), fork_of=8)]).results[0]
    assert runner.cached_len(9) == len(prompt) + 1 + 2
    check_valid(tok, grammar, first + out.plain.drafts)
    runner.release([8, 9])
    proposer.constraints.release([8, 9])
