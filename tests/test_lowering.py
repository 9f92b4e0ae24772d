"""Every Pallas path of jaxkv lowers for CUDA from this CPU-only host, through Triton, and its
TPU path for "tpu", through Mosaic.

`jax.jit(fn).trace(*abstract args).lower(lowering_platforms=("cuda",))` runs the whole
Pallas-to-Triton lowering without a GPU and without allocating anything, so the shapes are the
benchmarks' (Llama-3.1-8B attention: 32 query heads, 8 KV heads, head dim 128; page tables for
32K-128K tokens). Each Triton kernel is one `stablehlo.custom_call @__gpu$xla.gpu.triton` in the
lowered text, carrying the kernel's name and its results; identical calls share one lowering, so
the text lists each distinct kernel call once. Compiling the Triton IR needs a GPU (the `gpu`
tests, `benchmarks/gpu_check.sh`). Lowered for "tpu", the same programs hold the Mosaic paged
decode kernel and jax's splash attention (`stablehlo.custom_call @tpu_custom_call`, the kernel's
name in `kernel_name`) and no Triton call. Mosaic's own compilation needs libtpu and a TPU. The last
tests check that on this host backend "pallas" fails, when lowered for the CPU, with the error
naming the setting and its alternatives.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv import attention, policies
from jaxkv import pallas_kernels as pk
from jaxkv.cache import KVState
from jaxkv.cache.int8 import start_int8
from jaxkv.gates.wgkv import init_write_gates
from jaxkv.models import init_model
from jaxkv.models.configs import model_shape
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.step import parts
from jaxkv.step.forward import forward, forward_cached
from jaxkv.train import wgkv as wgkv_training
from tests.tiny_models import tiny_config

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton("
MOSAIC_CALL = "stablehlo.custom_call @tpu_custom_call("
# Kernel names (pallas_call `name=`), and the results of the paged kernel's call: accumulator,
# row max and row sum, plus the scores when per-slot probabilities are asked for.
FORWARD, DQ, DKV = (
    "block_sparse_attention_fwd",
    "block_sparse_attention_dq",
    "block_sparse_attention_dkv",
)
PAGED = "paged_decode_attention"
PAGED_RESULTS, PAGED_WITH_SCORES = 3, 4
# The Mosaic kernel's name and results: output and logsumexp, plus the scores.
PAGED_TPU = "paged_decode_attention_tpu"
PAGED_TPU_RESULTS = 2

# Llama-3.1-8B's attention shapes and the kernel benchmarks' tiles (benchmarks/kernel_inputs.py).
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
BLOCK_Q, BLOCK_K = 128, 64
WINDOW = 256  # WG-KV's band
S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


class TritonCall(NamedTuple):
    name: str
    results: int
    int8_operands: bool


def kernel_calls(text: str, call: str = TRITON_CALL) -> list[TritonCall]:
    """The kernel custom calls (Triton's, or Mosaic's with `MOSAIC_CALL`) of lowered StableHLO
    text, in order."""
    calls = []
    for line in text.splitlines():
        if call not in line:
            continue
        results = re.search(r"%[\w#]+(?::(\d+))? = stablehlo\.custom_call", line).group(1)
        operands = line[line.rindex(" : (") :].split(" -> ")[0]
        calls.append(
            TritonCall(
                re.search(r'(?:, |kernel_)name = "(\w+)"', line).group(1),
                int(results or 1),
                "xi8>" in operands,
            )
        )
    return calls


def triton_calls(text: str) -> list[TritonCall]:
    return kernel_calls(text, TRITON_CALL)


def mosaic_calls(text: str) -> list[TritonCall]:
    return kernel_calls(text, MOSAIC_CALL)


def lowered_for_cuda(fn, *args) -> tuple[str, jax.stages.Lowered]:
    return lowered_for(("cuda",), fn, *args)


def lowered_for(platforms, fn, *args) -> tuple[str, jax.stages.Lowered]:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=platforms)
    return lowered.as_text(), lowered


def names(calls: list[TritonCall]) -> set[str]:
    return {call.name for call in calls}


# --- The public ops of jaxkv.pallas_kernels, at the benchmarks' shapes ---------------------------


@pytest.mark.parametrize("tokens,list_heads,dtype", [(32768, KV_HEADS, BF16), (8192, HEADS, F32)])
def test_block_sparse_forward_and_backward_with_gate_bias(tokens, list_heads, dtype):
    """A prefill's forward and its gradient (WG-KV gate training): three kernels, the forward
    (kept for the VJP), dQ, and dK/dV/d(gate bias), with lists per KV head or per query head."""
    nq, nk = tokens // BLOCK_Q, tokens // BLOCK_K

    def loss(q, k, v, gate_bias, kv_block_idx, kv_block_cnt):
        out, lse = pk.block_sparse_attention(
            q,
            k,
            v,
            kv_block_idx,
            kv_block_cnt,
            sm_scale=HEAD_DIM**-0.5,
            gate_bias=gate_bias,
            band=WINDOW,
            block_q=BLOCK_Q,
            block_k=BLOCK_K,
            return_lse=True,
        )
        return jnp.sum(out.astype(F32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    text, lowered = lowered_for_cuda(
        jax.grad(loss, argnums=(0, 1, 2, 3)),
        S((1, HEADS, tokens, HEAD_DIM), dtype),
        S((1, KV_HEADS, tokens, HEAD_DIM), dtype),
        S((1, KV_HEADS, tokens, HEAD_DIM), dtype),
        S((1, KV_HEADS, tokens), F32),
        S((1, list_heads, nq, nk), I32),
        S((1, list_heads, nq), I32),
    )
    assert [call.name for call in triton_calls(text)] == [FORWARD, DQ, DKV]
    d_gate_bias = lowered.out_info[3]
    assert (d_gate_bias.shape, d_gate_bias.dtype) == ((1, KV_HEADS, tokens), F32)


def _paged_args(batch: int, tokens: int, pages_dtype, quantised: bool):
    max_pages = tokens // PAGE
    num_pages = batch * KV_HEADS * max_pages
    pool = S((num_pages, PAGE, HEAD_DIM), pages_dtype)
    args = [S((batch, HEADS, HEAD_DIM), BF16), pool, pool]
    args += [S((batch, KV_HEADS, max_pages), I32), S((batch, KV_HEADS), I32)]
    if quantised:
        token_scales, channel_scales = (
            S((num_pages, PAGE), F32),
            S((batch, KV_HEADS, HEAD_DIM), F32),
        )
        args += [token_scales, token_scales, channel_scales, channel_scales]
    return args


@pytest.mark.parametrize(
    "batch,tokens,int8,probs",
    [(8, 32768, False, False), (1, 131072, True, True), (32, 16384, True, False)],
)
@pytest.mark.parametrize("target", ["triton", "mosaic"])
def test_paged_decode_with_gqa_int8_scales_and_statistics(batch, tokens, int8, probs, target):
    """Decode over 32K-128K-token page tables, 4 query heads per KV head in one program, int8
    pages with token and channel scales, the logsumexp and the per-slot probabilities: one
    Triton call lowered for "cuda" (accumulator, max, sum, with probabilities the scores), one
    Mosaic call for "tpu" (output, logsumexp, with probabilities the scores)."""

    def decode(q, k_pages, v_pages, page_table, lengths, *scales):
        names = ("k_scales", "v_scales", "k_channel_scales", "v_channel_scales")
        quant = dict(zip(names[: len(scales)], scales, strict=True))
        return pk.paged_decode_attention(
            q,
            k_pages,
            v_pages,
            page_table,
            lengths,
            sm_scale=HEAD_DIM**-0.5,
            return_stats=True,
            return_probs=probs,
            target=target,
            **quant,
        )

    pages_dtype = jnp.int8 if int8 else BF16
    args = _paged_args(batch, tokens, pages_dtype, int8)
    if target == "triton":
        text, lowered = lowered_for_cuda(decode, *args)
        results = PAGED_WITH_SCORES if probs else PAGED_RESULTS
        assert triton_calls(text) == [TritonCall(PAGED, results, int8)]
    else:
        text, lowered = lowered_for(("tpu",), decode, *args)
        results = PAGED_TPU_RESULTS + probs
        assert mosaic_calls(text) == [TritonCall(PAGED_TPU, results, int8)]
    out, stats = lowered.out_info
    assert out.shape == (batch, HEADS, HEAD_DIM) and stats.lse.shape == (batch, HEADS)
    assert stats.probs is None if not probs else stats.probs.shape == (batch, HEADS, tokens)


# --- jaxkv.attention with backend "pallas" ------------------------------------------------------


def test_paged_attention_of_a_chunk_with_page_selection():
    """A prefill chunk's queries as rows of the paged kernel (G * C rows per KV head, in programs
    of CHUNK_ROWS), reading only the pages Quest selected."""
    chunk, tokens = 512, 32768
    q, k_pages, v_pages, page_table, lengths = _paged_args(1, tokens, BF16, False)

    def read(q, k_pages, v_pages, page_table, lengths, page_mask):
        return attention.paged_attention(
            q,
            k_pages,
            v_pages,
            page_table,
            lengths,
            sm_scale=HEAD_DIM**-0.5,
            page_mask=page_mask,
            backend="pallas",
        )

    text, lowered = lowered_for_cuda(
        read,
        S((1, HEADS, chunk, HEAD_DIM), BF16),
        k_pages,
        v_pages,
        page_table,
        lengths,
        S(page_table.shape, jnp.bool_),
    )
    assert triton_calls(text) == [TritonCall(PAGED, PAGED_RESULTS, False)]
    assert lowered.out_info[1].shape == (1, HEADS, chunk)


def test_a_second_segment_merges_with_the_cached_pages():
    """A ring kept in reserved pages is a second call of the paged kernel (its own table and
    lengths), merged with the first through the logsumexps: two kernel calls."""
    q, k_pages, v_pages, page_table, lengths = _paged_args(4, 32768, BF16, False)
    ring_table, ring_lengths = S((4, KV_HEADS, WINDOW // PAGE), I32), S((4, KV_HEADS), I32)

    def two_segments(q, k_pages, v_pages, page_table, lengths, ring_table, ring_lengths):
        step = dict(sm_scale=HEAD_DIM**-0.5, backend="pallas")
        q = q[:, :, None]
        cached = attention.paged_attention(q, k_pages, v_pages, page_table, lengths, **step)
        ring = attention.paged_attention(q, k_pages, v_pages, ring_table, ring_lengths, **step)
        return attention.merge_partials(*cached, *ring)

    text, _ = lowered_for_cuda(
        two_segments, q, k_pages, v_pages, page_table, lengths, ring_table, ring_lengths
    )
    assert [call.name for call in triton_calls(text)] == [PAGED, PAGED]


def test_wgkv_vertical_slash_chunk():
    """WG-KV's chunk attention to itself: the slash (block-sparse kernel over sliding-window
    lists, unadmitted keys masked by the gate bias) and the vertical (the admitted far keys,
    compacted and read by the paged kernel)."""
    chunk = 4096

    def chunk_attention(q, k, v, positions, admitted):
        return attention.vertical_slash_chunk_attention(
            q, k, v, positions, admitted, window=WINDOW, sm_scale=0.1, backend="pallas"
        )

    text, _ = lowered_for_cuda(
        chunk_attention,
        S((1, HEADS, chunk, HEAD_DIM), BF16),
        S((1, KV_HEADS, chunk, HEAD_DIM), BF16),
        S((1, KV_HEADS, chunk, HEAD_DIM), BF16),
        S((1, chunk), I32),
        S((1, KV_HEADS, chunk), jnp.bool_),
    )
    assert [call.name for call in triton_calls(text)] == [FORWARD, PAGED]


def test_batched_kernels_lower_under_vmap():
    q, k_pages, v_pages, page_table, lengths = _paged_args(1, 4096, BF16, False)

    def read(q, k_pages, v_pages, page_table, lengths):
        return attention.paged_attention(
            q[:, :, None], k_pages, v_pages, page_table, lengths, sm_scale=0.1, backend="pallas"
        )

    batched = [S((3, *arg.shape), arg.dtype) for arg in (q, k_pages, v_pages, page_table, lengths)]
    text, _ = lowered_for_cuda(jax.vmap(read), *batched)
    assert names(triton_calls(text)) == {PAGED}


# --- Whole programs: training losses, a prefill chunk and a decode step -------------------------

TINY = tiny_config()  # 4 query heads, 2 KV heads of 16 (the kernels' minimum head dim)


def _abstract_model(cfg):
    return jax.eval_shape(lambda: init_model(cfg, 0))


def test_training_forward_and_wgkv_gate_training_gradients():
    """The cache-free forward's loss gradient (pretraining) and WG-KV's gate distillation loss
    (remat, gate bias): the block-sparse forward and both backward kernels."""
    model = _abstract_model(TINY)
    tokens = S((2, 512), I32)

    def pretraining_loss(params, tokens):
        logits = forward(Model(TINY, params), tokens, backend="pallas", remat=True)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    text, _ = lowered_for_cuda(jax.grad(pretraining_loss), model.params, tokens)
    assert names(triton_calls(text)) == {FORWARD, DQ, DKV}

    spec = wgkv_training.GateTraining(band=64, seq_len=512)
    loss = wgkv_training.make_loss(TINY, spec, backend="pallas", remat=True)
    gates = jax.eval_shape(lambda: init_write_gates(TINY, jax.random.PRNGKey(0)))
    params = {"gates": gates, "backbone": model.params}
    batch = {"tokens": tokens, "valid": S((2, 512), jnp.bool_)}
    text, _ = lowered_for_cuda(jax.grad(lambda p, b: loss(p, b)[0]), params, batch)
    assert names(triton_calls(text)) == {FORWARD, DQ, DKV}


def _abstract_state(cfg, policy, batch: int, max_tokens: int, int8_window: int | None = None):
    def create():
        kv = KVState.create(
            num_layers=cfg.num_layers,
            batch=batch,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_tokens=max_tokens,
            page_size=PAGE,
            num_pages=batch * cfg.num_kv_heads * max_tokens // PAGE,
            dtype=BF16,
            key_bounds=policy.selection is not None,
            local_window=parts.local_window(policy),
        )
        return kv if int8_window is None else start_int8(kv, int8_window)

    return jax.eval_shape(create)


def cached_step_calls(
    cfg, policy, chunk: int, *, batch=2, max_tokens=1024, int8_window=None, platform="cuda"
):
    """The kernel calls of one `forward_cached` chunk (C = 1: a decode step) plus logits,
    lowered for `platform`: Triton's for "cuda", Mosaic's for "tpu" (which must hold no Triton
    call)."""
    model = _abstract_model(cfg)
    kv = _abstract_state(cfg, policy, batch, max_tokens, int8_window)
    params = None
    if policy.params is not None:
        params = jax.eval_shape(lambda: policy.params.init(cfg, jax.random.PRNGKey(0)))
    read_budget = S((batch,), I32) if policy.selection is not None else None
    static = policy.static()

    def step(model, tokens, positions, kv, params, read_budget):
        hidden, kv, _ = forward_cached(
            model,
            tokens,
            positions,
            kv,
            policy=static,
            backend="pallas",
            policy_params=params,
            read_budget=read_budget,
            thresholds=jnp.asarray(policy.thresholds(tokens.shape[0])),
        )
        return logits_from_hidden(model.params, model.config, hidden[:, -1]), kv

    tokens = S((batch, chunk), I32)
    text, _ = lowered_for((platform,), step, model, tokens, tokens, kv, params, read_budget)
    if platform == "cuda":
        return triton_calls(text)
    assert not triton_calls(text)
    return mosaic_calls(text)


CACHE_READ = TritonCall(PAGED, PAGED_RESULTS, False)
CHUNK_SELF = TritonCall(FORWARD, 2, False)  # the chunk's causal attention to itself: out, lse


@pytest.mark.parametrize("chunk", [1, 128])
def test_full_cache_decode_step_and_prefill_chunk(chunk):
    assert cached_step_calls(TINY, policies.FullCache(), chunk) == [CACHE_READ, CHUNK_SELF]


def test_decode_step_at_llama_8b_shapes_over_128k_tokens():
    """One decode step of the whole Llama-3.1-8B shape (32 layers in one scanned body) over a
    page table of 128K tokens per head."""
    cfg = model_shape("llama-3.1-8b")
    calls = cached_step_calls(cfg, policies.FullCache(), 1, batch=1, max_tokens=131072)
    assert calls == [CACHE_READ, CHUNK_SELF]


def test_h2o_decode_step_reads_probabilities_with_the_attention():
    """An attention-mass policy's decode step takes the per-slot probabilities from the kernel
    (the scores output), not from a second pass."""
    calls = cached_step_calls(TINY, policies.H2O(budget=64), 1)
    assert calls == [TritonCall(PAGED, PAGED_WITH_SCORES, False), CHUNK_SELF]


def test_int8_storage_decode_step_reads_both_tiers():
    calls = cached_step_calls(TINY, policies.FullCache(), 1, int8_window=64)
    assert calls == [CACHE_READ, TritonCall(PAGED, PAGED_RESULTS, True), CHUNK_SELF]


def test_quest_decode_step_reads_selected_pages():
    assert cached_step_calls(TINY, policies.Quest(budget=64), 1) == [CACHE_READ, CHUNK_SELF]


@pytest.mark.parametrize("chunk", [1, 256])
def test_wgkv_decode_step_and_prefill_chunk_with_the_ring(chunk):
    """WG-KV: cached pages, the ring (dense, jnp) and the chunk's vertical-slash attention; a
    chunk longer than the band also reads its admitted far keys through the paged kernel."""
    calls = cached_step_calls(TINY, policies.WGKV(tau=0.5, window=16), chunk)
    vertical = [CACHE_READ] if chunk > 16 else []
    assert calls[:2] == [CACHE_READ, CHUNK_SELF] and calls[2:] == vertical


@pytest.mark.parametrize("chunk", [1, 128])
def test_fastkvzip_decode_step_and_prefill_chunk(chunk):
    """Fast KVzip: its gate scores each written token (jnp); the attention is the kernels'."""
    calls = cached_step_calls(TINY, policies.FastKVzip(ratio=0.5), chunk)
    assert calls == [CACHE_READ, CHUNK_SELF]


# --- The TPU path: the Mosaic paged decode kernel and splash attention ----------------------------


TPU_CACHE_READ = TritonCall(PAGED_TPU, PAGED_TPU_RESULTS, False)
SPLASH = "splash_mqa_fwd"  # jax's splash attention kernels are named splash_mqa_{fwd,dq,dkv}...


@pytest.mark.parametrize(
    "policy,chunk,splash",
    [
        (policies.FullCache(), 1, False),  # a decode step's own token: jnp
        (policies.FullCache(), 128, True),
        (policies.H2O(budget=64), 1, False),
        (policies.Quest(budget=64), 1, False),
        (policies.FastKVzip(ratio=0.5), 128, True),
        # WG-KV's vertical-slash attention of a chunk to itself is jnp on a TPU.
        (policies.WGKV(tau=0.5, window=16), 128, False),
    ],
    ids=["full-decode", "full-chunk", "h2o-decode", "quest-decode", "fastkvzip-chunk", "wgkv"],
)
def test_tpu_decode_step_and_prefill_chunk(policy, chunk, splash):
    """Lowered for "tpu" with backend "pallas", a cached step reads the pages through the Mosaic
    kernel (H2O's probabilities with the read), a chunk of 128 tokens or more attends to itself
    through splash attention, and there is no Triton call."""
    calls = cached_step_calls(TINY, policy, chunk, platform="tpu")
    with_probs = isinstance(policy, policies.H2O)
    assert calls[0] == TPU_CACHE_READ._replace(results=PAGED_TPU_RESULTS + with_probs)
    assert [call.name.startswith(SPLASH) for call in calls[1:]] == ([True] if splash else [])


def test_tpu_training_forward_and_its_gradient_through_splash_attention():
    """A whole sequence's causal attention and its gradient lower for "tpu" to splash's forward
    and backward kernels (the Mosaic calls of `jax.grad`)."""
    tokens = 8192

    def loss(q, k, v):
        out = attention.causal_attention(q, k, v, sm_scale=HEAD_DIM**-0.5, backend="pallas")
        return jnp.sum(out.astype(F32))

    qkv = [S((1, heads, tokens, HEAD_DIM), BF16) for heads in (HEADS, KV_HEADS, KV_HEADS)]
    text, _ = lowered_for(("tpu",), jax.grad(loss, argnums=(0, 1, 2)), *qkv)
    names = [call.name for call in mosaic_calls(text)]
    assert names[0].startswith(SPLASH) and len(names) == 3 and not triton_calls(text)
    assert {name.split("_")[2] for name in names} == {"fwd", "dq", "dkv"}


def test_tpu_int8_storage_decode_step_reads_the_int8_tier_in_the_kernel():
    calls = cached_step_calls(TINY, policies.FullCache(), 1, int8_window=16, platform="tpu")
    assert TritonCall(PAGED_TPU, PAGED_TPU_RESULTS, True) in calls


# --- Backend "pallas" where there is no GPU: checked when lowered for the platform --------------

PALLAS_ERROR = r"backend='pallas'.*NVIDIA GPU.*platform 'cpu'.*'interpret'.*'xla'"


def test_pallas_resolves_anywhere_and_fails_when_lowered_for_the_cpu():
    assert attention.resolve_backend("pallas") is attention.Backend.PALLAS
    q, k_pages, v_pages, page_table, lengths = _paged_args(1, 1024, BF16, False)

    def read(q, k_pages, v_pages, page_table, lengths):
        return attention.paged_attention(
            q[:, :, None], k_pages, v_pages, page_table, lengths, sm_scale=0.1, backend="pallas"
        )

    traced = jax.jit(read).trace(q, k_pages, v_pages, page_table, lengths)
    for platforms in (("cpu",), ("cuda", "cpu"), ("tpu", "cpu")):
        with pytest.raises(ValueError, match=PALLAS_ERROR):
            traced.lower(lowering_platforms=platforms)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert triton_calls(cuda) and not mosaic_calls(cuda)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert mosaic_calls(tpu) and not triton_calls(tpu)


def test_generate_with_pallas_on_a_cpu_names_the_setting_and_the_alternatives():
    """`generate` runs on the default device: a CPU here (made so on a GPU host too)."""
    with jax.default_device(jax.devices("cpu")[0]):
        model = init_model(TINY, 0)
        with pytest.raises(ValueError, match=PALLAS_ERROR):
            jaxkv.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=2, backend="pallas")
