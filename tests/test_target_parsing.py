"""target_service/parsing.py: a StepRequest is checked completely before anything runs. A sequence's
SamplingParams are checked once per distinct message and reused on its later steps; a message never
seen is checked in full, so a bad one is refused (naming its field) even after good ones were kept."""

from __future__ import annotations

import pytest

from engine.logits import Processors
from engine.runner import InvalidInput
from tandem.v1 import common_pb2, target_pb2
from target_service.acceptance import Rule
from target_service.parsing import StepParser


def _entry(sampling: common_pb2.SamplingParams, k: int = 0, emit: bool = True) -> target_pb2.StepEntry:
    return target_pb2.StepEntry(seq_id=1, start_pos=10, tokens=[5, *range(20, 20 + k)], num_draft_tokens=k,
                                emit=emit, sampling=sampling, logprobs=-1, prompt_len=8)


def _request(*entries: target_pb2.StepEntry) -> target_pb2.StepRequest:
    return target_pb2.StepRequest(entries=list(entries))


def test_a_sampling_message_is_checked_once_and_reused(monkeypatch):
    parser = StepParser(vocab_size=100, max_model_len=512, max_draft_tokens=4)
    checks = []
    real = Processors.from_proto
    monkeypatch.setattr(Processors, "from_proto", staticmethod(lambda p, n, v: checks.append(n) or real(p, n, v)))
    penalized = common_pb2.SamplingParams(temperature=0.0, repetition_penalty=1.5)
    first = parser.parse(_request(_entry(penalized)))[0]
    again = parser.parse(_request(_entry(penalized, k=2)))[0]
    assert len(checks) == 1, "the same message on a later step is not checked again"
    assert first.processors == again.processors == Processors(repetition=1.5, prompt_len=8)
    assert again.k == 2 and again.verification is not None and again.verification.rule == Rule.STRICT
    parser.parse(_request(_entry(common_pb2.SamplingParams(temperature=0.0, repetition_penalty=1.2))))
    assert len(checks) == 2, "another message is checked"
    parser.parse(_request(_entry(penalized, emit=False)))
    assert len(checks) == 3, "a prompt chunk (not emitting) is checked for what it uses: its own entry"


@pytest.mark.parametrize(("sampling", "field"), [
    (common_pb2.SamplingParams(temperature=-1.0), "entries[1].sampling"),
    (common_pb2.SamplingParams(temperature=0.0, logit_bias={500: 1.0}), "entries[1].sampling"),
    (common_pb2.SamplingParams(temperature=0.0, acceptance=7), "entries[1].sampling.acceptance"),
    (common_pb2.SamplingParams(temperature=0.0, typical_epsilon=2.0), "entries[1].sampling.typical_epsilon"),
])
def test_a_bad_message_is_refused_after_good_ones_were_kept(sampling, field):
    parser = StepParser(vocab_size=100, max_model_len=512, max_draft_tokens=4)
    good = common_pb2.SamplingParams(temperature=0.0)
    parser.parse(_request(_entry(good)))
    with pytest.raises(InvalidInput) as err:
        parser.parse(_request(_entry(good), _entry(sampling)))
    assert err.value.field.startswith(field)
    with pytest.raises(InvalidInput):  # refused again: a failed check is not kept
        parser.parse(_request(_entry(good), _entry(sampling)))
