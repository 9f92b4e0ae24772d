"""Conf-KV on the reference model: trace, perplexity over generated length, needles, KL premise.

  trace   cache bytes held and confidence per decode step of one long teacher-forced read (the
          sawtooth of the paper's Fig. 8), plotted.
  ppl     bits per byte over a held-out continuation read token by token with each policy's
          decode-time eviction running after every token (the paper's perplexity over generated
          length), per length bin; sliding window and H2O at the memory Conf-KV held (mean
          tokens per head), the matched-rate ablations (random victims, recency only alpha=0,
          attention only alpha=1), pyramid and int8 storage; the fraction of the sliding
          window's gap to the full cache that each policy closes.
  needle  exact-match accuracy of `generate` on needle episodes; SnapKV, PyramidKV, H2O and the
          sliding window at the tokens per head Conf-KV held.
  kl      Pearson r between the confidence of the full-context next-token distribution and the
          KL shift KL(p_full || p_ablated) when the newest 256 tokens before the query are
          removed from its context (the query token itself stays), on held-out text.

Memory is what the cache actually holds (`memory_bytes`: pages in use of both tiers, scales and
per-token metadata), averaged over decode steps. Sample counts are small (CPU); see --help.

    PYTHONPATH=$PWD python -m jaxkv.benchmarks.confkv --out results/confkv
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import bundled, policies, tasks
from jaxkv.forward import forward_cached
from jaxkv.models import load_hf_checkpoint
from jaxkv.models.decoder import forward, logits_from_hidden
from jaxkv.policies.base import DecodeContext, after_decode_step
from jaxkv.policies.confkv import Ranking, confidence
from jaxkv.train import corpus as corpus_lib

REFERENCE_MODEL = bundled.REFERENCE_MODEL
BOS, EOS, PAD = 256, 257, 258
PAGE_SIZE = 16
SEED = 20_000  # disjoint from training (< 10000) and the quality benchmark (10000+)


@dataclasses.dataclass(frozen=True)
class Settings:
    prefix: int = 320  # bytes prefilled before the teacher-forced read (> every budget)
    continuation: int = 512  # bytes read token by token
    texts: int = 2
    tight: int = 96
    loose: int = 192
    protected: int = 40  # < tight * gamma_min for the pyramid (the default 64 would not fit)
    needle_length: int = 1024
    needle_samples: int = 4
    needle_tight: int = 256
    needle_loose: int = 512
    kl_texts: int = 2
    kl_points: int = 24  # query positions per text
    kl_length: int = 768
    kl_ablated: int = 256
    bins: int = 4


QUICK = Settings(
    prefix=128,
    continuation=64,
    texts=1,
    tight=48,
    loose=96,
    protected=16,
    needle_length=256,
    needle_samples=1,
    needle_tight=96,
    needle_loose=128,
    kl_texts=1,
    kl_points=4,
    kl_length=320,
    kl_ablated=64,
    bins=2,
)


def _rng(task: str) -> np.random.Generator:
    return np.random.default_rng([SEED, sum(map(ord, task))])


# --- teacher-forced reading with decode-time eviction ----------------------------------------


@functools.partial(jax.jit, static_argnames="policy")
def _read(
    model, kv, tokens, targets, starts, budget_tokens, budget_ratio, key, policy_params, policy
):
    """Reads tokens [B, N] one by one from positions `starts` [B], the policy's decode hook
    after each (on the steps it is due, as in `generate`).

    Returns per step: nll f32 [N, B] of targets, confidence [N, B], pages in use of both
    tiers [N, 2], mean tokens held per head [N].
    """

    def step(kv, xs):
        token, target, i = xs
        positions = starts + i
        hidden, kv, _ = forward_cached(
            model,
            token[:, None],
            positions[:, None],
            kv,
            policy=policy,
            policy_params=policy_params,
        )
        logits = logits_from_hidden(model.params, model.config, hidden[:, 0])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), target[:, None], axis=-1)[:, 0]
        ctx = DecodeContext(
            prompt_lengths=starts,
            budget_tokens=budget_tokens,
            budget_ratio=budget_ratio,
            positions=positions,
            logits=logits,
            key=jax.random.fold_in(key, i),
            step=i + 1,
            group_size=model.config.group_size,
        )
        kv = after_decode_step(policy, kv, ctx)
        int8_pages = 0 if kv.pool.int8 is None else kv.pool.int8.pages_in_use()
        pages = jnp.stack([kv.pages_in_use(), jnp.asarray(int8_pages, jnp.int32)])
        held = jnp.mean(kv.lengths.astype(jnp.float32))
        return kv, (nll, confidence(logits), pages, held)

    steps = jnp.arange(tokens.shape[1])
    _, out = jax.lax.scan(step, kv, (tokens.T, targets.T, steps))
    return out


def _bytes_per_step(kv, pages: np.ndarray) -> np.ndarray:
    """Bytes held per step from pages in use [N, 2] of both tiers."""
    held = pages[:, 0].astype(np.int64) * kv.pool.page_bytes
    if kv.pool.int8 is not None:
        tier = kv.pool.int8
        held += pages[:, 1].astype(np.int64) * tier.pool.page_bytes + tier.channel_scale_bytes
    return held


def teacher_forced(model, policy, texts: list[bytes], s: Settings, policy_params=None) -> dict:
    """Prefills `s.prefix` bytes of each text, then reads `s.continuation` bytes token by token
    with the policy's decode hook after each; bits per byte, memory held and the trace."""
    rows = np.array([[BOS, *text] for text in texts], np.int32)
    prefix = s.prefix + 1
    kv = jaxkv.compress_prompt(
        model,
        rows[:, :prefix],
        policy,
        page_size=PAGE_SIZE,
        reserve_tokens=s.continuation,
        policy_params=policy_params,
    )
    starts = np.full((len(texts),), prefix, np.int32)
    budget_tokens = jnp.asarray(policy.budget_tokens(starts))
    nll, conf, pages, held = _read(
        model,
        kv,
        jnp.asarray(rows[:, prefix : prefix + s.continuation]),
        jnp.asarray(rows[:, prefix + 1 : prefix + 1 + s.continuation]),
        jnp.asarray(starts),
        budget_tokens,
        jnp.asarray(policy.budget_ratio(len(texts))),
        jax.random.PRNGKey(SEED),
        policy_params,
        policy.static(),
    )
    nll, conf, pages, held = (np.asarray(x) for x in (nll, conf, pages, held))
    memory = _bytes_per_step(kv, pages) / len(texts)
    bins = np.array_split(np.arange(nll.shape[0]), s.bins)
    return {
        "bits_per_byte": float(nll.mean() / math.log(2)),
        "bits_per_byte_by_length": [
            {"until": int(b[-1]) + 1, "bpb": float(nll[b].mean() / math.log(2))} for b in bins
        ],
        "kv_bytes_per_sequence": float(memory.mean()),
        "tokens_per_head": float(held.mean()),
        "confident_fraction": float(np.mean(conf >= getattr(policy, "tau", policies.ConfKV.tau))),
        "trace": {
            "kv_bytes": memory.tolist(),
            "tokens_per_head": held.tolist(),
            "confidence": conf[:, 0].tolist(),
        },
    }


def ppl_policies(s: Settings, matched: int) -> dict:
    """Policies of the perplexity comparison; baselines at `matched` tokens per head."""
    confkv = policies.ConfKV(tight=s.tight, loose=s.loose, protected=s.protected)
    return {
        "h2o": policies.H2O(budget=matched, recent=s.protected),
        "sliding_window": policies.SlidingWindow(budget=matched),
        "streaming_llm": policies.StreamingLLM(budget=matched),
        "confkv_pyramid": dataclasses.replace(confkv, pyramid=True),
        # F below the tight budget, so that the int8 tier holds something.
        "confkv_int8": dataclasses.replace(confkv, storage="int8", full_precision_window=32),
        "confkv_random": dataclasses.replace(confkv, ranking=Ranking.RANDOM),
        "confkv_recency_alpha0": dataclasses.replace(confkv, alpha=0.0),
        "confkv_attention_alpha1": dataclasses.replace(confkv, alpha=1.0),
    }


def run_ppl(model, corpus, s: Settings, log=print) -> dict:
    rng = _rng("ppl")
    texts = [corpus.text(rng, s.prefix + s.continuation + 1) for _ in range(s.texts)]
    results = {"full": teacher_forced(model, policies.FullCache(), texts, s)}
    log("ppl full", results["full"]["bits_per_byte"])
    confkv = policies.ConfKV(tight=s.tight, loose=s.loose, protected=s.protected)
    results["confkv"] = teacher_forced(model, confkv, texts, s)
    log("ppl confkv", results["confkv"]["bits_per_byte"])
    matched = max(int(round(results["confkv"]["tokens_per_head"])), 1)
    for name, policy in ppl_policies(s, matched).items():
        results[name] = teacher_forced(model, policy, texts, s)
        log("ppl", name, results[name]["bits_per_byte"], results[name]["tokens_per_head"])
    window, full = results["sliding_window"]["bits_per_byte"], results["full"]["bits_per_byte"]
    for result in results.values():
        gap = window - full
        result["sliding_gap_closed"] = (window - result["bits_per_byte"]) / gap if gap else None
    return {"matched_tokens_per_head": matched, "policies": results}


# --- needles -----------------------------------------------------------------------------


def needle_accuracy(model, policy, episodes) -> dict:
    prompts = [[BOS, *e.prompt] for e in episodes]
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=max(len(e.answer) for e in episodes),
        policy=policy,
        stop_tokens=[EOS],
        pad_id=PAD,
        page_size=PAGE_SIZE,
    )
    correct = [
        bytes(int(t) for t in out.tokens[i, : len(e.answer)] if t < 256) == e.answer
        for i, e in enumerate(episodes)
    ]
    steps = out.memory_bytes[1:] if len(out.memory_bytes) > 1 else out.memory_bytes
    return {
        "accuracy": float(np.mean(correct)),
        "kv_bytes_per_sequence": float(steps.mean()) / len(episodes),
        "tokens_per_head": float(np.asarray(out.state.lengths).mean()),
    }


def run_needles(model, corpus, s: Settings, log=print) -> dict:
    rng = _rng("needle")
    depths = np.linspace(0.0, 1.0, s.needle_samples)
    episodes = [tasks.needle(corpus, rng, s.needle_length - 1, depth=float(d)) for d in depths]
    confkv = policies.ConfKV(tight=s.needle_tight, loose=s.needle_loose, protected=s.protected)
    results = {
        "full": needle_accuracy(model, policies.FullCache(), episodes),
        "confkv": needle_accuracy(model, confkv, episodes),
    }
    matched = max(int(round(results["confkv"]["tokens_per_head"])), 1)
    others = {
        "confkv_pyramid": dataclasses.replace(confkv, pyramid=True),
        "confkv_int8": dataclasses.replace(confkv, storage="int8"),
        "snapkv": policies.SnapKV(budget=matched),
        "pyramidkv": policies.PyramidKV(budget=matched),
        "h2o": policies.H2O(budget=matched, recent=s.protected),
        "sliding_window": policies.SlidingWindow(budget=matched),
    }
    for name, policy in others.items():
        results[name] = needle_accuracy(model, policy, episodes)
        log("needle", name, results[name])
    return {"matched_tokens_per_head": matched, "policies": results}


# --- KL premise ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="policy")
def _query_logits(model, kv, tokens, positions, policy):
    hidden, _, _ = forward_cached(model, tokens, positions, kv, policy=policy)
    return logits_from_hidden(model.params, model.config, hidden[:, 0])


def run_kl(model, corpus, s: Settings, log=print) -> dict:
    """Confidence of p_full at each query position vs KL(p_full || p_ablated)."""
    rng = _rng("kl")
    full_policy = policies.FullCache()
    confidences, shifts = [], []
    for _ in range(s.kl_texts):
        row = np.array([BOS, *corpus.text(rng, s.kl_length)], np.int32)
        full_logits = forward(model, jnp.asarray(row[None]))[0]  # [T, V]
        queries = np.linspace(s.kl_ablated + 16, len(row) - 1, s.kl_points).astype(int)
        prefixes = [row[: t - s.kl_ablated] for t in queries]  # context without the newest 256
        kv = jaxkv.compress_prompt(
            model,
            [p.tolist() for p in prefixes],
            full_policy,
            page_size=PAGE_SIZE,
            reserve_tokens=1,
        )
        ablated = _query_logits(
            model,
            kv,
            jnp.asarray(row[queries][:, None]),
            jnp.asarray(queries[:, None].astype(np.int32)),
            full_policy.static(),
        )
        log_p = jax.nn.log_softmax(full_logits[queries], axis=-1)
        log_q = jax.nn.log_softmax(ablated, axis=-1)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
        confidences.extend(np.asarray(confidence(full_logits[queries])).tolist())
        shifts.extend(np.asarray(kl).tolist())
    r = float(np.corrcoef(confidences, shifts)[0, 1])
    log("kl pearson r", r)
    return {"pearson_r": r, "points": len(shifts), "confidence": confidences, "kl": shifts}


# --- report --------------------------------------------------------------------------------


def plot_trace(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = result["trace"]
    fig, size_axis = plt.subplots(figsize=(9, 3.5))
    size_axis.plot(trace["tokens_per_head"], color="tab:blue", lw=1)
    size_axis.set_xlabel("decode step")
    size_axis.set_ylabel("tokens held per head", color="tab:blue")
    conf_axis = size_axis.twinx()
    conf_axis.plot(trace["confidence"], color="tab:orange", lw=0.6, alpha=0.7)
    conf_axis.axhline(0.7, color="tab:orange", ls=":", lw=1)
    conf_axis.set_ylabel("confidence (seq 0)", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ppl(ppl: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    for name, result in ppl["policies"].items():
        bins = result["bits_per_byte_by_length"]
        axis.plot([b["until"] for b in bins], [b["bpb"] for b in bins], marker="o", label=name)
    axis.set_xlabel("generated length (bytes)")
    axis.set_ylabel("bits per byte (bin)")
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(report: dict) -> str:
    lines = [
        "| policy | bpb | gap closed | tokens/head | KV KiB/seq | confident |",
        "|---" * 6 + "|",
    ]
    for name, r in report["ppl"]["policies"].items():
        gap = "-" if r["sliding_gap_closed"] is None else f"{r['sliding_gap_closed']:.2f}"
        lines.append(
            f"| {name} | {r['bits_per_byte']:.4f} | {gap} | {r['tokens_per_head']:.0f} | "
            f"{r['kv_bytes_per_sequence'] / 1024:.0f} | {r['confident_fraction']:.2f} |"
        )
    lines += ["", "| policy | needle acc | tokens/head | KV KiB/seq |", "|---" * 4 + "|"]
    for name, r in report["needle"]["policies"].items():
        lines.append(
            f"| {name} | {r['accuracy']:.2f} | {r['tokens_per_head']:.0f} | "
            f"{r['kv_bytes_per_sequence'] / 1024:.0f} |"
        )
    kl = report["kl"]
    lines += ["", f"KL premise: Pearson r = {kl['pearson_r']:.3f} over {kl['points']} points"]
    return "\n".join(lines) + "\n"


def _timed_log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m jaxkv.benchmarks.confkv", description=__doc__)
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--out", type=Path, default=Path("results/confkv"))
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    model = load_hf_checkpoint(args.model, dtype="float32")
    heldout = corpus_lib.load_corpus("heldout")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"settings": dataclasses.asdict(s), "jax": jax.__version__}
    report["kl"] = run_kl(model, heldout, s, log=_timed_log)
    report["ppl"] = run_ppl(model, heldout, s, log=_timed_log)
    report["needle"] = run_needles(model, heldout, s, log=_timed_log)
    (args.out / "confkv.json").write_text(json.dumps(report) + "\n")
    plot_trace(report["ppl"]["policies"]["confkv"], args.out / "trace.png")
    plot_ppl(report["ppl"], args.out / "ppl_by_length.png")
    text = table(report)
    (args.out / "confkv.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
