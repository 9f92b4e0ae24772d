"""Teacher-forced reading with decode-time eviction: prefill a text's start, then read the rest
token by token through the public `decode_step` (the policy's decode eviction on the steps it
is due, as in `generate`), scoring each next token. The Conf-KV, decode-block and Fast KVzip
decode benchmarks read this way; `Reading` draws their texts in a model's own ids."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.generation import Rows, StepContext, decode_step
from jaxkv.models import Tokenizer
from jaxkv.policies.confkv import confidence, confident_steps
from jaxkv.prose import prose
from jaxkv.step.rows import row_keys
from jaxkv.train import corpus as corpus_lib

BOS = 256  # the byte-level model's
PAGE_SIZE = 16
PAGES = jaxkv.CacheConfig(page_size=PAGE_SIZE)
SEED = 20_000  # disjoint from training (< 10000) and the quality benchmark (10000+)


def rng_for(task: str) -> np.random.Generator:
    """The generator of a task's draws (texts, bootstrap), disjoint from training's seeds."""
    return np.random.default_rng([SEED, sum(map(ord, task))])


TEXTS = ("heldout", "prose")


@dataclasses.dataclass(frozen=True)
class Reading:
    """The texts a run reads: `text` ("heldout" or "prose") in `tokenizer`'s ids."""

    tokenizer: Tokenizer
    text: str

    def __post_init__(self):
        if self.text not in TEXTS:
            raise ValueError(f"text={self.text!r}: expected one of {TEXTS}")

    @property
    def opening(self) -> list[int]:
        """The ids every row opens with: the BOS where the tokenizer adds one."""
        return self.tokenizer.encode("")

    def rows(self, task: str, count: int, length: int) -> np.ndarray:
        """int32 [count, len(opening) + length]: `count` texts of `length` tokens after the
        opening, drawn from the task's own seed (the same rows for every policy)."""
        rng = rng_for(task)
        if self.text == "heldout":
            corpus = corpus_lib.load_corpus("heldout")
            texts = [corpus.token_ids(rng, self.tokenizer, length) for _ in range(count)]
        else:
            seeds = rng.integers(0, 2**31, count)
            texts = [self._prose_ids(int(seed), length) for seed in seeds]
        return np.array([[*self.opening, *text] for text in texts], np.int32)

    def _prose_ids(self, seed: int, length: int) -> list[int]:
        """The first `length` ids of paragraphs shuffled by `seed` (4 characters a token at
        least, else the docs are read again with more)."""
        chars = 4 * length
        while True:
            ids = self.tokenizer.encode(prose(chars, seed=seed), add_bos=False)
            if len(ids) >= length:
                return ids[:length]
            chars *= 2  # ValueError past what the docs hold


@functools.partial(jax.jit, static_argnames="policy")
def _read(
    model,
    kv,
    tokens,
    targets,
    starts,
    budget_tokens,
    budget_ratio,
    thresholds,
    key,
    policy_params,
    policy,
):
    """Reads tokens [B, N] one by one from positions `starts` [B], the policy's decode
    eviction after each (on the steps it is due, as in `generate`).

    Returns per step: nll f32 [N, B] of targets, confidence [N, B], tight-budget steps
    bool [N, B] (Conf-KV's rule; False for other policies), pages in use of both tiers [N, 2],
    mean tokens held per head [N].
    """

    batch = starts.shape[0]
    rows = Rows.start(
        prompt_lengths=starts,
        budget_tokens=budget_tokens,
        budget_ratio=budget_ratio,
        thresholds=thresholds,
        keys=row_keys(key, jnp.arange(batch)),
        sampling=jaxkv.Sampler().rows(batch),
    )
    everyone = jnp.ones((batch,), bool)
    # As in `generate`: step i reads the token sampled after i + 1 were generated.
    rows = rows.advanced(everyone)
    context = StepContext(rows=rows, policy_params=policy_params, policy=policy)

    def step(carry, xs):
        kv, rows = carry
        token, target = xs
        kv, logits = decode_step(model, kv, token, everyone, context.replace(rows=rows))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), target[:, None], axis=-1)[:, 0]
        int8_pages = 0 if kv.pool.int8 is None else kv.pool.int8.pages_in_use()
        pages = jnp.stack([kv.pages_in_use(), jnp.asarray(int8_pages, jnp.int32)])
        held = jnp.mean(kv.lengths.astype(jnp.float32))
        if isinstance(policy, policies.ConfKV):
            confident = confident_steps(logits, thresholds, policy.weights)
        else:
            confident = jnp.zeros(logits.shape[:1], bool)
        return (kv, rows.advanced(everyone)), (nll, confidence(logits), confident, pages, held)

    _, out = jax.lax.scan(step, (kv, rows), (tokens.T, targets.T))
    return out


def _bytes_per_step(kv, pages: np.ndarray) -> np.ndarray:
    """Bytes held per step from pages in use [N, 2] of both tiers."""
    held = pages[:, 0].astype(np.int64) * kv.pool.page_bytes
    if kv.pool.int8 is not None:
        tier = kv.pool.int8
        held += pages[:, 1].astype(np.int64) * tier.pool.page_bytes + tier.channel_scale_bytes
    return held


def byte_rows(texts: list[bytes]) -> np.ndarray:
    """int32 [B, 1 + len] the byte-level model's ids of equal-length texts: BOS, then the bytes
    (`teacher_forced` then prefills `1 + prefix` of them)."""
    return np.array([[BOS, *text] for text in texts], np.int32)


def teacher_forced(
    model,
    policy,
    rows: np.ndarray,
    prefill: int,
    continuation: int,
    bins: int = 4,
    policy_params=None,
    cache=None,
) -> dict:
    """Prefills the first `prefill` tokens of each row [B, prefill + continuation + 1], then
    reads `continuation` tokens one by one with the policy's decode eviction after each; bits
    per token (overall, per text and in `bins` spans of the read), memory held and the trace.
    `cache`: the CacheConfig (default: pages of PAGE_SIZE in the model dtype)."""
    if rows.shape[1] < prefill + continuation + 1:
        raise ValueError(f"rows of {rows.shape[1]} tokens: need {prefill + continuation + 1}")
    kv = jaxkv.compress_prompt(
        model,
        rows[:, :prefill],
        policy,
        cache=cache or PAGES,
        reserve_tokens=continuation,
        policy_params=policy_params,
    )
    starts = np.full((len(rows),), prefill, np.int32)
    budget_tokens = jnp.asarray(policy.budget_tokens(starts))
    nll, conf, confident, pages, held = _read(
        model,
        kv,
        jnp.asarray(rows[:, prefill : prefill + continuation]),
        jnp.asarray(rows[:, prefill + 1 : prefill + 1 + continuation]),
        jnp.asarray(starts),
        budget_tokens,
        jnp.asarray(policy.budget_ratio(len(rows))),
        jnp.asarray(policy.thresholds(len(rows))),
        jax.random.PRNGKey(SEED),
        policy_params,
        policy.static(),
    )
    nll, conf, confident, pages, held = (np.asarray(x) for x in (nll, conf, confident, pages, held))
    memory = _bytes_per_step(kv, pages) / len(rows)
    spans = np.array_split(np.arange(nll.shape[0]), bins)
    return {
        "bits_per_token": float(nll.mean() / math.log(2)),
        "bits_per_token_per_text": (nll.mean(axis=0) / math.log(2)).tolist(),
        "bits_per_token_by_length": [
            {"until": int(b[-1]) + 1, "bits": float(nll[b].mean() / math.log(2))} for b in spans
        ],
        "kv_bytes_per_sequence": float(memory.mean()),
        "tokens_per_head": float(held.mean()),
        "confident_fraction": float(np.mean(confident)),
        "trace": {
            "kv_bytes": memory.tolist(),
            "tokens_per_head": held.tolist(),
            "confidence": conf[:, 0].tolist(),
        },
    }
