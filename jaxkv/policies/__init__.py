"""Cache policies (admission, eviction, selection) over the paged KV state."""

from jaxkv.policies.base import (
    Budget,
    DecodeContext,
    FullCache,
    Policy,
    PrefillObservations,
    Storage,
    get,
    register,
    registered,
)
from jaxkv.policies.confkv import ConfidenceWeights, ConfKV, Ranking, confidence
from jaxkv.policies.eviction import DecodeEviction, EvictionPolicy, LayerView
from jaxkv.policies.fastkvzip import FastKVzip
from jaxkv.policies.gvote import GVote
from jaxkv.policies.kvzip import KVzip
from jaxkv.policies.quest import Quest
from jaxkv.policies.sage import SageKV
from jaxkv.policies.scorers import (
    H2O,
    TOVA,
    AdaKV,
    Knorm,
    ObservedAttention,
    PyramidKV,
    SlidingWindow,
    SnapKV,
    StreamingLLM,
)

__all__ = [
    "H2O",
    "TOVA",
    "AdaKV",
    "Budget",
    "ConfKV",
    "ConfidenceWeights",
    "DecodeContext",
    "DecodeEviction",
    "EvictionPolicy",
    "FastKVzip",
    "FullCache",
    "GVote",
    "KVzip",
    "Knorm",
    "LayerView",
    "ObservedAttention",
    "Policy",
    "PrefillObservations",
    "PyramidKV",
    "Quest",
    "Ranking",
    "SageKV",
    "SlidingWindow",
    "SnapKV",
    "Storage",
    "StreamingLLM",
    "confidence",
    "get",
    "register",
    "registered",
]
