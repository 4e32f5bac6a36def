"""Tandem's model runtime, shared by the draft and target services."""

from engine.config import EngineConfig, ModelConfig, UnsupportedModelError
from engine.kv_cache import BlockManager, KVCacheExhausted
from engine.runner import CacheMiss, InvalidInput, ModelRunner, SeqInput

__all__ = [
    "BlockManager",
    "CacheMiss",
    "EngineConfig",
    "InvalidInput",
    "KVCacheExhausted",
    "ModelConfig",
    "ModelRunner",
    "SeqInput",
    "UnsupportedModelError",
]
