"""Sampling parameters: one type from the front doors to the wire, with one set of defaults.

A request names only what it wants to change; everything else comes from the served model's
generation_config.json (as transformers and vLLM apply it), else OpenAI's defaults
(temperature 1, top_p 1, top_k 0, min_p 0). The router resolves them once, at the door.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.v1 import common_pb2

MAX_BAD_WORDS = 128  # token sequences per request (vLLM's default VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORD_TOKENS = 32
MAX_ALLOWED_TOKEN_IDS = 1 << 20


class InvalidField(ValueError):
    """A request field is out of range: HTTP 400 / gRPC INVALID_ARGUMENT. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_sampling(temperature: float, top_p: float, top_k: int, field: str = "sampling",
                      min_p: float = 0.0) -> list[str]:
    """Problems with these parameters, each naming its field ([] when valid)."""
    problems = []
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        problems.append(f"{field}.temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        problems.append(f"{field}.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        problems.append(f"{field}.top_k must be >= 0, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        problems.append(f"{field}.min_p must be in [0, 1], got {min_p}")
    return problems


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0  # 0: disabled
    seed: int | None = None  # set: reproducible whatever shares the batch
    typical_acceptance: bool = False  # lossy opt-in (Medusa); strict rejection sampling otherwise
    # logits processors (proto/tandem/v1/common.proto says how each applies)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: every other id is out; () = no restriction
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output must not contain
    thinking_token_budget: int | None = None  # vLLM's: thinking past it is ended (think_tokens says how)
    think_tokens: tuple[int, int | None] | None = None  # (end, start or None: the output starts thinking)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, held_back: tuple[int, ...] = ()) -> None:
        """InvalidField naming the first bad parameter. held_back: what min_tokens keeps out besides
        stop_token_ids (EOS)."""
        problems = validate_sampling(self.temperature, self.top_p, self.top_k, "sampling", self.min_p)
        if problems:
            name = problems[0].split(" ", 1)[0].removeprefix("sampling.")
            raise InvalidField(name, problems[0].split(" ", 1)[1])
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidField("seed", "must be in [0, 2^63)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidField(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidField("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidField("logit_bias", "each bias must be in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidField("logit_bias", "token ids must be distinct")
        if self.min_tokens < 0:
            raise InvalidField("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            raise InvalidField("bad_words", f"at most {MAX_BAD_WORDS} token sequences of 1 to {MAX_BAD_WORD_TOKENS} "
                                            "tokens each")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidField("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids")
        if self.thinking_token_budget is not None and (self.thinking_token_budget < 0 or self.think_tokens is None):
            raise InvalidField("thinking_token_budget", "must be >= 0, with the think-end token")
        out = {w[0] for w in self.bad_words if len(w) == 1}
        if self.min_tokens:
            out |= set(self.stop_token_ids) | set(held_back)
        if self.allowed_token_ids and set(self.allowed_token_ids) <= out:  # a row of -inf: nothing to sample
            raise InvalidField("allowed_token_ids", "bad_words (or the stop ids min_tokens holds back) rule out "
                                                    "every allowed token")


    def check_vocab(self, vocab: int) -> None:
        """InvalidField naming the first field with a token id outside [0, vocab)."""
        named = (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                 ("allowed_token_ids", self.allowed_token_ids), ("bad_words", [t for w in self.bad_words for t in w]),
                 ("thinking_token_budget", [t for t in self.think_tokens or () if t is not None]))
        for field, ids in named:
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise InvalidField(field, f"token ids must be in [0, {vocab})")

    @property
    def processed(self) -> bool:
        """Whether any logits processor is on (else the services skip that work entirely)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.allowed_token_ids)
                or bool(self.bad_words) or self.thinking_token_budget is not None)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: a seeded request's choices get distinct derived seeds
        (the same seed would draw the same tokens), choice 0 keeps the request's own."""
        if index == 0 or self.seed is None:
            return self
        digest = hashlib.blake2b(f"{self.seed}:choice:{index}".encode(), digest_size=8).digest()
        return dataclasses.replace(self, seed=int.from_bytes(digest, "little") >> 1)

    def updated(self, **given: object) -> SamplingParams:
        """These defaults with the request's own values (None = not given) on top."""
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def to_proto(self, held_back: tuple[int, ...] = ()) -> common_pb2.SamplingParams:
        """The wire form. held_back: the ids min_tokens keeps out besides stop_token_ids (EOS), sent
        only while min_tokens matters; processors left at their defaults are not sent at all."""
        msg = common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            acceptance=common_pb2.ACCEPTANCE_TYPICAL if self.typical_acceptance else common_pb2.ACCEPTANCE_STRICT)
        for name in ("presence_penalty", "frequency_penalty", "min_p"):
            if getattr(self, name):
                setattr(msg, name, getattr(self, name))
        if self.repetition_penalty != 1.0:
            msg.repetition_penalty = self.repetition_penalty
        msg.logit_bias.update(dict(self.logit_bias))
        if self.min_tokens:
            msg.min_tokens = self.min_tokens
            msg.stop_token_ids.extend(sorted(set(self.stop_token_ids) | set(held_back)))
        msg.allowed_token_ids.extend(self.allowed_token_ids)
        msg.bad_words.extend(common_pb2.TokenIds(ids=w) for w in self.bad_words)
        if self.thinking_token_budget is not None:
            msg.thinking_token_budget = self.thinking_token_budget
        if self.think_tokens is not None:
            msg.think_end_token = self.think_tokens[0]
            if self.think_tokens[1] is not None:
                msg.think_start_token = self.think_tokens[1]
        return msg

    @staticmethod
    def given_in(msg: common_pb2.SamplingParams) -> dict[str, object]:
        """The fields a proto message sets (for updated())."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens")
        given: dict[str, object] = {name: getattr(msg, name) for name in names if msg.HasField(name)}
        if msg.acceptance == common_pb2.ACCEPTANCE_TYPICAL:
            given["typical_acceptance"] = True
        if msg.logit_bias:
            given["logit_bias"] = tuple(sorted(msg.logit_bias.items()))
        if msg.stop_token_ids:
            given["stop_token_ids"] = tuple(msg.stop_token_ids)
        if msg.allowed_token_ids:
            given["allowed_token_ids"] = tuple(msg.allowed_token_ids)
        if msg.bad_words:
            given["bad_words"] = tuple(tuple(w.ids) for w in msg.bad_words)
        if msg.HasField("thinking_token_budget"):
            given["thinking_token_budget"] = msg.thinking_token_budget
            given["think_tokens"] = (msg.think_end_token,
                                     msg.think_start_token if msg.HasField("think_start_token") else None)
        return given

    @classmethod
    def from_generation_config(cls, model_dir: str | Path) -> SamplingParams:
        """The checkpoint's sampling defaults (generation_config.json); do_sample false means greedy."""
        path = Path(model_dir) / "generation_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        repetition = float(raw.get("repetition_penalty", 1.0) or 1.0)  # applied by default, as vLLM does
        if raw.get("do_sample") is False:
            return cls(temperature=0.0, repetition_penalty=repetition)
        return cls(temperature=float(raw.get("temperature", 1.0)), top_p=float(raw.get("top_p", 1.0)),
                   top_k=int(raw.get("top_k", 0) or 0), min_p=float(raw.get("min_p", 0.0) or 0.0),
                   repetition_penalty=repetition)
