"""The byte-level tasks of the quality benchmarks on the reference model, one policy at a time.

Episodes come from `jaxkv.tasks` on the held-out corpus split, seeds disjoint from training:
  needle, multikey, multivalue, vartrack  `generate` (greedy, the policy's prefill compression
      and decode hooks), scored by exact match of the answer;
  multiquestion  the context alone is compressed once, then several multikey questions are asked
      of that same cache (copies of it), so the cache must serve questions it never saw;
  bpb  bits per byte of a held-out continuation read over the compressed context.
Multiquestion and bpb continue from the compressed context's `jaxkv.Session` (`extend`, then
`decode` or the continuation's logits), the policy's rules applied as in `generate`. Memory is
what the cache actually holds after prefill and compression (`memory_bytes`), per sequence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import tasks
from jaxkv.generation import extend_with_logits
from jaxkv.models import Model

BOS, EOS, PAD = 256, 257, 258  # the byte-level tokenizer's
QA_TASKS = ("needle", "multikey", "multivalue", "vartrack")
TASKS = (*QA_TASKS, "multiquestion", "bpb")
EVAL_SEED = 10_000  # training draws from seeds below this, on the train split
PAGE_SIZE = 16
QUESTIONS = 3
CONTINUATION_BYTES = 256


def _rng(task: str, length: int) -> np.random.Generator:
    return np.random.default_rng([EVAL_SEED, TASKS.index(task), length])


def qa_episodes(task: str, corpus, length: int, samples: int) -> list[tasks.Episode]:
    """Needles sweep the depths evenly; the other kinds draw theirs."""
    rng = _rng(task, length)
    prompt_length = length - 1
    if task == "needle":
        depths = np.linspace(0.0, 1.0, samples)
        return [tasks.needle(corpus, rng, prompt_length, depth=float(d)) for d in depths]
    return [tasks.make_episode(task, corpus, rng, prompt_length) for _ in range(samples)]


def _num_pages(model: Model, batch: int, tokens: int) -> int:
    cfg = model.config
    return cfg.num_layers * batch * cfg.num_kv_heads * -(-tokens // PAGE_SIZE)


def run_qa(model, policy, episodes, policy_params=None) -> dict:
    prompts = [[BOS, *episode.prompt] for episode in episodes]
    answer_bytes = max(len(episode.answer) for episode in episodes)
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=answer_bytes,
        policy=policy,
        stop_tokens=[EOS],
        pad_id=PAD,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        policy_params=policy_params,
    )
    correct = [
        bytes(int(t) for t in out.tokens[i, : len(e.answer)] if t < 256) == e.answer
        for i, e in enumerate(episodes)
    ]
    # Tokens each sequence holds at the end, averaged over layers and KV heads: budgets that
    # adapt per request (GVote, Conf-KV) show their spread here.
    held = np.asarray(out.state.lengths).mean(axis=(0, 2))
    if out.state.ring is not None:  # WG-KV's local ring holds the last W tokens on top
        held = held + np.minimum(np.asarray(out.state.ring.count), out.state.ring.window).mean(0)
    return {
        "accuracy": float(np.mean(correct)),
        "kv_bytes_per_sequence": float(out.memory_bytes[0]) / len(episodes),
        "kv_tokens_held": [round(float(t), 1) for t in held],
    }


def _compressed_context(
    model, policy, contexts: list[bytes], extra_tokens: int, policy_params=None
):
    prompts = [[BOS, *context] for context in contexts]
    longest = max(map(len, prompts)) + extra_tokens
    session = jaxkv.prefill(
        model,
        prompts,
        policy,
        cache=jaxkv.CacheConfig(
            page_size=PAGE_SIZE, num_pages=_num_pages(model, len(prompts), longest)
        ),
        reserve_tokens=extra_tokens,
        policy_params=policy_params,
    )
    return session, session.memory_bytes() / len(prompts)


def run_multiquestion(model, policy, corpus, length: int, samples: int, policy_params=None) -> dict:
    """Several multikey facts per context; the compressed context answers each question."""
    rng = _rng("multiquestion", length)
    contexts, questions, answers = [], [], []
    for _ in range(samples):
        episode = tasks.needle(corpus, rng, length - 1, num_keys=QUESTIONS)
        asked = episode.prompt.rindex(b"\n# What is the special magic number")
        contexts.append(episode.prompt[:asked])
        names = [
            line.split(b" for ")[1].split(b" is ")
            for line in episode.prompt[:asked].split(b"\n")
            if line.startswith(b"# The special magic number for ")
        ]
        questions.append(
            [
                b"\n# What is the special magic number for %s? "
                b"The special magic number for %s is " % (name, name)
                for name, _ in names
            ]
        )
        answers.append([value.rstrip(b".") + b".\n" for _, value in names])
    steps = max(len(a) for row in answers for a in row)
    extra = max(len(q) for row in questions for q in row) + steps
    session, kv_bytes = _compressed_context(model, policy, contexts, extra, policy_params)
    correct = []
    for index in range(QUESTIONS):
        rows = [list(row[index]) for row in questions]
        generated = jaxkv.decode(session.extend(rows), steps, stop_tokens=(), pad_id=PAD).tokens
        for i, row in enumerate(answers):
            correct.append(bytes(int(t) for t in generated[i, : len(row[index])]) == row[index])
    return {"accuracy": float(np.mean(correct)), "kv_bytes_per_sequence": kv_bytes}


def run_bpb(model, policy, corpus, length: int, samples: int, policy_params=None) -> dict:
    """Bits per byte of the next CONTINUATION_BYTES bytes after a compressed context."""
    rng = _rng("bpb", length)
    texts = [corpus.text(rng, length - 1 + CONTINUATION_BYTES) for _ in range(samples)]
    contexts = [text[: length - 1] for text in texts]
    continuations = [list(text[length - 1 :]) for text in texts]
    session, kv_bytes = _compressed_context(
        model, policy, contexts, CONTINUATION_BYTES, policy_params
    )
    _, logits = extend_with_logits(session, [row[:-1] for row in continuations])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.asarray([row[1:] for row in continuations])
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return {
        "bits_per_byte": float(jnp.mean(nll)) / math.log(2),
        "kv_bytes_per_sequence": kv_bytes,
    }


def run_task(model, policy, corpus, task: str, length: int, samples: int, policy_params=None):
    """One task's result dict for one policy (and its parameters, if it takes any)."""
    if task in QA_TASKS:
        episodes = qa_episodes(task, corpus, length, samples)
        return run_qa(model, policy, episodes, policy_params)
    if task == "multiquestion":
        return run_multiquestion(model, policy, corpus, length, samples, policy_params)
    return run_bpb(model, policy, corpus, length, samples, policy_params)
