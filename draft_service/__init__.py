"""Tandem's draft-model service: mirrors prompt chunks into the draft KV cache (Sync) and
proposes k draft tokens per decoding sequence in batched rounds (Propose)."""

from draft_service.drafts import DraftRequest, DraftResult, Proposals, SparseQ
from draft_service.proposer import Proposer
from draft_service.server import SERVICE_NAME, DraftServicer, create_servicer, register

__all__ = [
    "SERVICE_NAME",
    "DraftRequest",
    "DraftResult",
    "DraftServicer",
    "Proposals",
    "Proposer",
    "SparseQ",
    "create_servicer",
    "register",
]
