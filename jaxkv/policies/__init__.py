"""Cache policies (admission, eviction, selection) over the paged KV state."""

from jaxkv.policies.base import (
    Budget,
    FullCache,
    LearnedParams,
    Policy,
    SummedMass,
    get,
    policy_class,
    register,
    registered,
)
from jaxkv.policies.cam import CAM
from jaxkv.policies.cap import Cap
from jaxkv.policies.compactor import Compactor
from jaxkv.policies.compose import Composed, compose
from jaxkv.policies.confkv import (
    ConfidenceWeights,
    ConfKV,
    Ranking,
    confidence,
    confidence_features,
    confidence_from_features,
    confidence_logit,
    is_confident,
)
from jaxkv.policies.critical import CriticalAdaKV, CriticalKV
from jaxkv.policies.decoding import Decoding, RatioDecoding
from jaxkv.policies.dms import DMS
from jaxkv.policies.entropy_chunks import EntropyGatedChunkKV
from jaxkv.policies.eviction import DecodeEvictionPolicy, EvictionPolicy, LayerView
from jaxkv.policies.expected_attention import (
    ExpectedAttention,
    ExpectedAttentionStats,
    QueryStatistics,
)
from jaxkv.policies.fastkvzip import FastKVzip, SinkGateParams
from jaxkv.policies.finch import Finch
from jaxkv.policies.gvote import GVote
from jaxkv.policies.kvcompose import KVCompose
from jaxkv.policies.kvgrad import KVgrad
from jaxkv.policies.kvzap import KVzap, SurrogateParams
from jaxkv.policies.kvzip import KVzip
from jaxkv.policies.leverage import LeverageScore
from jaxkv.policies.lukv import LUKV, BudgetCurve
from jaxkv.policies.merging import Merging
from jaxkv.policies.noncausal import NonCausalAttention
from jaxkv.policies.per_layer import PerLayer
from jaxkv.policies.qfilter import QFilter, QueryFilters
from jaxkv.policies.query_agnostic import CUR, KeyDiff, LagKV, Random
from jaxkv.policies.quest import Quest
from jaxkv.policies.rerotation import KeyRerotation
from jaxkv.policies.sage import SageKV
from jaxkv.policies.scissorhands import Scissorhands
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
from jaxkv.policies.simlayerkv import SimLayerKV
from jaxkv.policies.spec import from_spec
from jaxkv.policies.structure import Block, Chunk, ChunkKV
from jaxkv.policies.think import ThinK
from jaxkv.policies.wgkv import (
    WGKV,
    DuoAttention,
    LocalAttention,
    RetrievalHeads,
    RingAdmission,
    WriteGateParams,
    attention_mass,
    long_range_attention_mass,
    retrieval_heads,
)
from jaxkv.step.parts import DecodeContext, PrefillObservations

__all__ = [
    "H2O",
    "TOVA",
    "ThinK",
    "WGKV",
    "CUR",
    "AdaKV",
    "Block",
    "Budget",
    "CAM",
    "Cap",
    "Chunk",
    "ChunkKV",
    "Compactor",
    "Composed",
    "ConfKV",
    "ConfidenceWeights",
    "CriticalAdaKV",
    "CriticalKV",
    "DMS",
    "DecodeContext",
    "Decoding",
    "DecodeEvictionPolicy",
    "DuoAttention",
    "EntropyGatedChunkKV",
    "EvictionPolicy",
    "ExpectedAttention",
    "ExpectedAttentionStats",
    "FastKVzip",
    "Finch",
    "FullCache",
    "GVote",
    "KVCompose",
    "KVgrad",
    "KVzap",
    "KVzip",
    "KeyDiff",
    "KeyRerotation",
    "Knorm",
    "LeverageScore",
    "LUKV",
    "BudgetCurve",
    "LagKV",
    "LayerView",
    "LearnedParams",
    "LocalAttention",
    "Merging",
    "NonCausalAttention",
    "ObservedAttention",
    "PerLayer",
    "Policy",
    "PrefillObservations",
    "PyramidKV",
    "QFilter",
    "QueryFilters",
    "QueryStatistics",
    "Quest",
    "Random",
    "RatioDecoding",
    "Ranking",
    "RetrievalHeads",
    "RingAdmission",
    "SageKV",
    "SinkGateParams",
    "SurrogateParams",
    "Scissorhands",
    "SimLayerKV",
    "SlidingWindow",
    "SnapKV",
    "StreamingLLM",
    "SummedMass",
    "WriteGateParams",
    "attention_mass",
    "compose",
    "confidence",
    "confidence_features",
    "confidence_from_features",
    "confidence_logit",
    "from_spec",
    "get",
    "is_confident",
    "long_range_attention_mass",
    "policy_class",
    "register",
    "registered",
    "retrieval_heads",
]
