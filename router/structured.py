"""Structured output in the router, which owns each constrained sequence's grammar state.

    door        the body's constraint (response_format, vLLM's structured_outputs, guided_*) -> Constraint
    submit      Grammars.compile: llguidance's serialized grammar, checked once (bad schema: 400)
    each step   SeqGrammar.masks(drafts): the target's k + 1 masks (the state after the history, then
                after d_1 .. d_i, computed on the matcher and rolled straight back); drafts are cut at
                the first one the grammar refuses (the target could never accept it)
    apply       SeqGrammar.advance(emitted): the matcher consumes what the target emitted; a complete
                grammar ends the sequence ("stop")
The draft gets the grammar string once (its start_pos 0 entries) and keeps its own matcher per branch.
Masks are packed bits, zlib-compressed for the wire: a JSON grammar's masks are long runs (all of a
string's characters allowed, or only a few structural tokens), so a 6 KB mask of a 49k vocabulary
shrinks to ~0.4 KB (measured: docs/architecture.md, "Structured output").
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.grammar import GrammarError, Matcher, compile_grammar, load_tokenizer
from common.sampling import InvalidField as RequestError  # router.core.RequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to: kind in json_schema, json_object, regex, choice, grammar."""

    kind: str
    value: object
    field: str  # the request field it came from, named in errors

    @staticmethod
    def from_openai(response_format: dict | None, structured_outputs: dict | None,
                    legacy: dict[str, object]) -> Constraint | None:
        """At most one of: response_format (OpenAI), structured_outputs (vLLM), guided_* (vLLM's older names)."""
        found: list[Constraint] = []
        if response_format is not None:
            kind = response_format.get("type")
            if kind == "json_object":
                found.append(Constraint("json_object", None, "response_format"))
            elif kind == "json_schema":
                spec = response_format.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                    raise RequestError("response_format.json_schema", "needs a \"schema\" object")
                found.append(Constraint("json_schema", spec["schema"], "response_format.json_schema"))
            elif kind != "text":
                raise RequestError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
        names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
        for key, value in (structured_outputs or {}).items():
            if key == "json_object" and value:
                found.append(Constraint("json_object", None, "structured_outputs.json_object"))
            elif key in names and value is not None:
                found.append(Constraint(names[key], _schema(value, f"structured_outputs.{key}") if key == "json"
                                        else value, f"structured_outputs.{key}"))
            elif key not in names and key != "json_object":
                raise RequestError(f"structured_outputs.{key}", "not supported (json, regex, choice, grammar, "
                                                                "json_object are)")
        for key, value in legacy.items():
            if value is not None:
                kind = names[key.removeprefix("guided_")]
                found.append(Constraint(kind, _schema(value, key) if kind == "json_schema" else value, key))
        if len(found) > 1:
            raise RequestError(found[1].field, f"one output constraint per request (also given: {found[0].field})")
        return found[0] if found else None


def _schema(value: object, field: str) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise RequestError(field, f"not valid JSON: {err}") from None
    return value


class Grammars:
    """Compiles constraints against the served vocabulary (the target's logits width and EOS ids)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = load_tokenizer(str(Path(tokenizer_dir) / "tokenizer.json"), vocab_size, tuple(eos_ids))
        self.stop_ids = frozenset(eos_ids)

    def compile(self, constraint: Constraint) -> str:
        try:
            return compile_grammar(constraint.kind, constraint.value, self.tokenizer)
        except GrammarError as err:
            raise RequestError(constraint.field, str(err)) from None

    def state(self, grammar: str, opens_after: int | None = None) -> SeqGrammar:
        return SeqGrammar(Matcher(self.tokenizer, grammar), self.stop_ids, opens_after)


class SeqGrammar:
    """One sequence's grammar state: the matcher has consumed exactly its accepted output (after the
    think-end token `opens_after`, for a reasoning model: until the model emits it, the grammar waits)."""

    def __init__(self, matcher: Matcher, stop_ids: frozenset[int], opens_after: int | None = None) -> None:
        self.matcher = matcher
        self.stop_ids = stop_ids
        self.opens_after = opens_after  # None once it holds

    def masks(self, drafts: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """(the drafts worth verifying, one wire mask per decided position: len(drafts) + 1, or none at
        all where nothing is constrained)."""
        if self.opens_after is not None:
            return self._thinking_masks(drafts)
        m = self.matcher
        masks = [m.mask()]
        kept: list[int] = []
        for d in drafts:
            if d in self.stop_ids or not m.allowed(masks[-1], d) or not m.consume(d):
                break  # refused: the target could never accept it (an EOS draft is found by the target itself)
            kept.append(d)
            masks.append(m.mask())
        m.rollback(len(kept))
        return kept, [zlib.compress(mask, 1) for mask in masks]  # 6 KB -> ~0.4 KB on a 49k vocabulary, ~18 us

    def _thinking_masks(self, drafts: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """While the model thinks nothing is masked; a draft that ends the thinking is the last one
        verified, and the position after it is the grammar's first:

            drafts  d1  d2  </think>  (d4 d5: cut)
            masks   all all all       first
        """
        assert self.opens_after is not None
        if self.opens_after not in drafts:
            return list(drafts), []
        kept = list(drafts[:list(drafts).index(self.opens_after) + 1])
        first = self.matcher.mask()
        everything = zlib.compress(b"\xff" * len(first), 1)  # bits past the vocabulary are ignored
        return kept, [everything] * len(kept) + [zlib.compress(first, 1)]

    def advance(self, emitted: Sequence[int]) -> tuple[list[int], bool]:
        """Consume the target's tokens: (those to keep, whether the grammar is now complete)."""
        if self.opens_after is not None:
            end = next((n for n, t in enumerate(emitted) if t in self.stop_ids or t == self.opens_after), None)
            if end is None:
                return list(emitted), False
            if emitted[end] in self.stop_ids:  # the model stopped while thinking: a sequence like any other
                return list(emitted[:end + 1]), True
            self.opens_after = None
            kept, complete = self.advance(emitted[end + 1:])
            return [*emitted[:end + 1], *kept], complete
        for n, t in enumerate(emitted):
            if t in self.stop_ids:
                return list(emitted[:n + 1]), True
            if not self.matcher.consume(t):
                log.error("the target emitted token %d, which the grammar refuses: ending the sequence", t)
                return list(emitted[:n]), True
            if self.matcher.stopped:
                return list(emitted[:n + 1]), True
        return list(emitted), False
