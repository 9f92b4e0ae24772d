"""Attention dispatch: every attention the cached forward and the policies run goes through here.

Backends are chosen explicitly; there is no silent fallback:
  "xla"            plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"         Pallas kernels: Triton on NVIDIA GPUs; on TPUs the Mosaic paged-decode kernel
                   and splash attention for causal prefill;
  "interpret"      the Triton kernels in the Pallas interpreter (CPU tests);
  "interpret-tpu"  the TPU path in the interpreters (CPU tests);
  "auto"           "pallas" on a GPU, "xla" elsewhere (`resolve_backend`; `dispatch` says why).
"pallas" is checked where the platform is known: when a program is lowered (`dispatch`).

Shapes: B batch, N query heads, K KV heads, G = N // K, T/C query tokens, S key tokens, H head dim.
Queries are [B, N, T, H] and keys/values [B, K, S, H]; query head n reads KV head n // G.
Partial results carry a logsumexp so that attention over disjoint key sets (cached pages and the
current chunk) merges exactly (`merge_partials`).

Modules:
  dispatch        `Backend`, `resolve_backend`, `check_runs_here`, the lowering-time platform
                  check of the Triton kernels and the kernel tile choices;
  dense           dense attention under a mask (`grouped_scores`, the one grouped-query score
                  product), whole-sequence causal / gated / block-sparse attention, a chunk's
                  attention to itself, the WG-KV ring's local attention, `merge_partials`;
  paged           attention over cached pages (`paged_attention`: gather, int8 dequantisation,
                  Quest's page selection, or the ragged paged decode kernel);
  statistics      the attention mass policies accumulate (`mass_from_probs`,
                  `chunk_attention_mass`);
  vertical_slash  WG-KV's vertical-slash attention of a chunk to itself.
"""

from jaxkv.attention.dense import (
    attention_probabilities,
    block_mask_from_lists,
    block_sparse_attention,
    causal_attention,
    chunk_attention,
    gated_causal_attention,
    group_queries,
    grouped_scores,
    local_attention,
    masked_attention,
    merge_partials,
)
from jaxkv.attention.dispatch import Backend, check_runs_here, resolve_backend
from jaxkv.attention.paged import (
    dequantize,
    gather_pages,
    paged_attention,
    paged_attention_mass,
    probs_come_with_attention,
    selected_page_table,
)
from jaxkv.attention.statistics import attention_mass, chunk_attention_mass, mass_from_probs
from jaxkv.attention.vertical_slash import vertical_slash_chunk_attention

__all__ = [
    "Backend",
    "attention_mass",
    "attention_probabilities",
    "block_mask_from_lists",
    "block_sparse_attention",
    "causal_attention",
    "check_runs_here",
    "chunk_attention",
    "chunk_attention_mass",
    "dequantize",
    "gated_causal_attention",
    "gather_pages",
    "group_queries",
    "grouped_scores",
    "local_attention",
    "masked_attention",
    "mass_from_probs",
    "merge_partials",
    "paged_attention",
    "paged_attention_mass",
    "probs_come_with_attention",
    "resolve_backend",
    "selected_page_table",
    "vertical_slash_chunk_attention",
]
