"""Conf-KV on a model: trace, perplexity over generated length, needles, KL premise.

  trace   cache bytes held and confidence per decode step of one long teacher-forced read (the
          sawtooth of the paper's Fig. 8), plotted.
  ppl     bits per token over a held-out continuation read token by token with each policy's
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
  ablation  why Conf-KV closes less of the sliding window's gap than the paper: one row per
          Conf-KV variant (per-layer/per-head ranking, evict_every, alpha, beta, random victims,
          a fixed budget, tau, budgets halved/doubled), each against the full cache and a
          sliding window holding the same tokens per head, with a bootstrap interval over texts.

Texts (`--text`): `heldout`, the held-out split of the byte-level reference model's corpus (its
default), or `prose`, paragraphs of Python's own documentation (`jaxkv.prose`; the default for
any other model), in the model's own tokens. Lengths in the settings are tokens (bytes on the
byte-level model, where bits per token are bits per byte). The needle part is byte-level only
(`jaxkv bench real_quality` has needles for other models).

Baselines at "equal memory" evict at every step (`evict_every=1`), so that they hold exactly the
tokens per head Conf-KV held on average (with the default `evict_every=32` a window of budget W
holds W..W+31).

Memory is what the cache actually holds (`memory_bytes`: pages in use of both tiers, scales and
per-token metadata), averaged over decode steps. Sample counts are small (CPU); see --help.

    jaxkv bench confkv --out results/confkv
    jaxkv bench confkv --parts ablation --set ablation_texts=12
    jaxkv bench confkv --model smollm2-135m-instruct --parts ppl --set texts=24 --set prefix=512 \
        --set continuation=512 --set tight=128 --set loose=512 --set protected=48 \
        --out results/confkv-smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import bundled, policies, tasks
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.confkv_report import plot_ppl, plot_trace, table
from jaxkv.benchmarks.confkv_settings import QUICK, Settings, with_overrides
from jaxkv.benchmarks.teacher_forced import (
    BOS,
    PAGE_SIZE,
    PAGES,
    TEXTS,
    Reading,
    rng_for,
    teacher_forced,
)
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.models.decoder import forward, logits_from_hidden
from jaxkv.models.tokenizer import is_byte_tokenizer
from jaxkv.policies.confkv import Ranking, confidence
from jaxkv.step.forward import forward_cached
from jaxkv.train import corpus as corpus_lib

REFERENCE_MODEL = bundled.REFERENCE_MODEL
EOS, PAD = 257, 258
# Conf-KV's mixed precision: F below the tight budget, so that the int8 tier holds something.
INT8_CACHE = jaxkv.CacheConfig(page_size=PAGE_SIZE, storage="int8", full_precision_window=32)


def ppl_policies(s: Settings, matched: int) -> dict:
    """Policies of the perplexity comparison; baselines at `matched` tokens per head, evicting
    at every step so that they hold exactly that many."""
    confkv = policies.ConfKV(tight=s.tight, loose=s.loose, protected=s.protected)
    return {
        "h2o": policies.H2O(budget=matched, recent=s.protected, evict_every=1),
        "sliding_window": policies.SlidingWindow(budget=matched, evict_every=1),
        "streaming_llm": policies.StreamingLLM(budget=matched, evict_every=1),
        "confkv_pyramid": dataclasses.replace(confkv, pyramid=True),
        "confkv_random": dataclasses.replace(confkv, ranking=Ranking.RANDOM),
        "confkv_recency_alpha0": dataclasses.replace(confkv, alpha=0.0),
        "confkv_attention_alpha1": dataclasses.replace(confkv, alpha=1.0),
        "confkv_int8": (confkv, INT8_CACHE),  # (policy, cache); last: the slowest on a CPU
    }


def gap_closed(full, window, policy, rng: np.random.Generator, resamples: int) -> dict:
    """Share of the window's gap to the full cache that `policy` closes, from per-text bits per
    byte [T] (equal lengths): (sum window - sum policy) / (sum window - sum full), with a 90%
    percentile interval from resampling the texts (paired: the same texts for all three)."""
    full, window, policy = (np.asarray(x, np.float64) for x in (full, window, policy))
    gap = window.sum() - full.sum()
    picks = rng.integers(0, len(full), (resamples, len(full)))
    resampled_gap = window[picks].sum(axis=1) - full[picks].sum(axis=1)
    ok = resampled_gap > 0
    shares = (window[picks].sum(axis=1) - policy[picks].sum(axis=1))[ok] / resampled_gap[ok]
    return {
        "share": float((window.sum() - policy.sum()) / gap) if gap else None,
        "interval_90": np.percentile(shares, [5, 95]).tolist() if shares.size else None,
        "per_text": ((window - policy) / np.where(window != full, window - full, np.nan)).tolist(),
        "texts": len(full),
    }


def _close_gaps(results: dict, full: dict, s: Settings, task: str) -> None:
    """Adds to every result the share of the gap to the full cache it closes: `gap_closed` of
    the sliding window's (the paper's comparison) and `streaming_gap_closed` of StreamingLLM's
    (the window with attention sinks), each with its interval."""
    for key, baseline in (
        ("gap_closed", "sliding_window"),
        ("streaming_gap_closed", "streaming_llm"),
    ):
        reference = results[baseline]["bits_per_token_per_text"]
        for result in results.values():
            result[key] = gap_closed(
                full["bits_per_token_per_text"],
                reference,
                result["bits_per_token_per_text"],
                rng_for(task),
                s.bootstrap,
            )


def run_ppl(model, reading: Reading, s: Settings, log=print) -> dict:
    ppl_policies(s, matched=1)  # settings no policy accepts fail here, before any reading
    rows = reading.rows("ppl", s.texts, s.prefix + s.continuation + 1)
    prefill = len(reading.opening) + s.prefix

    def read(policy, cache=None):
        return teacher_forced(model, policy, rows, prefill, s.continuation, s.bins, cache=cache)

    results = {"full": read(policies.FullCache())}
    log("ppl full", results["full"]["bits_per_token"])
    confkv = policies.ConfKV(tight=s.tight, loose=s.loose, protected=s.protected)
    results["confkv"] = read(confkv)
    log("ppl confkv", results["confkv"]["bits_per_token"], results["confkv"]["tokens_per_head"])
    matched = max(int(round(results["confkv"]["tokens_per_head"])), 1)
    for name, policy in ppl_policies(s, matched).items():
        policy, cache = policy if isinstance(policy, tuple) else (policy, None)
        results[name] = read(policy, cache)
        log("ppl", name, results[name]["bits_per_token"], results[name]["tokens_per_head"])
    _close_gaps(results, results["full"], s, "ppl-bootstrap")
    return {"matched_tokens_per_head": matched, "texts": len(rows), "policies": results}


# --- ablation: why the gap closes less than in the paper --------------------------------------


def ablation_rows(s: Settings) -> dict:
    """Conf-KV variants of the ablation, each changing one thing from the first."""
    base = policies.ConfKV(tight=s.tight, loose=s.loose, protected=s.protected)
    fixed = dataclasses.replace(base, loose=s.tight)  # one budget: the ranking alone
    return {
        "default": base,  # per-layer ranking, evict_every 32, alpha 0.5, beta 0.9, tau 0.7
        "per_head": dataclasses.replace(base, per_head=True),
        "evict_every_1": dataclasses.replace(base, evict_every=1),
        "per_head_evict_every_1": dataclasses.replace(base, per_head=True, evict_every=1),
        "recency_alpha0": dataclasses.replace(base, alpha=0.0),  # the schedule alone
        "attention_alpha1": dataclasses.replace(base, alpha=1.0),
        "random_victims": dataclasses.replace(base, ranking=Ranking.RANDOM),
        "beta_0.99": dataclasses.replace(base, beta=0.99),
        "fixed_budget": fixed,
        "fixed_budget_recency": dataclasses.replace(fixed, alpha=0.0),
        "tau_0.5": dataclasses.replace(base, tau=0.5),
        "tau_0.9": dataclasses.replace(base, tau=0.9),
        "budgets_x0.5": dataclasses.replace(
            base, tight=s.tight // 2, loose=s.loose // 2, protected=s.protected // 2
        ),
        "budgets_x2": dataclasses.replace(
            base, tight=2 * s.tight, loose=2 * s.loose, protected=2 * s.protected
        ),
    }


def _summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "trace"}


def run_ablation(
    model, reading: Reading, s: Settings, rows: list[str] | None = None, log=print
) -> dict:
    """Each row: Conf-KV variant, a sliding window holding the tokens per head it held
    (evicting every step), the full cache, the gap closed with its interval, on the same texts."""
    variants = ablation_rows(s)
    unknown = sorted(set(rows or ()) - set(variants))
    if unknown:
        raise ValueError(f"unknown ablation rows {unknown}: the rows are {list(variants)}")
    variants = {name: variants[name] for name in rows} if rows else variants
    settings = dataclasses.replace(s, continuation=s.ablation_continuation)
    texts = reading.rows("ablation", s.ablation_texts, s.prefix + settings.continuation + 1)
    prefill = len(reading.opening) + s.prefix

    def read(policy):
        read = teacher_forced(model, policy, texts, prefill, settings.continuation, settings.bins)
        return _summary(read)

    full = read(policies.FullCache())
    log("ablation full", full["bits_per_token"])
    windows, out = {}, {}
    for name, policy in variants.items():
        result = read(policy)
        matched = max(int(round(result["tokens_per_head"])), 1)
        if matched not in windows:
            windows[matched] = read(policies.SlidingWindow(budget=matched, evict_every=1))
        window = windows[matched]
        closed = gap_closed(
            full["bits_per_token_per_text"],
            window["bits_per_token_per_text"],
            result["bits_per_token_per_text"],
            rng_for("ablation-bootstrap"),
            s.bootstrap,
        )
        out[name] = {"policy": repr(policy), "confkv": result, "window_tokens": matched}
        out[name] |= {"window": window, "gap_closed": closed}
        log("ablation", name, result["bits_per_token"], window["bits_per_token"], closed["share"])
    return {
        "texts": len(texts),
        "prefix": s.prefix,
        "continuation": settings.continuation,
        "full": full,
        "rows": out,
    }


# --- needles -----------------------------------------------------------------------------


def needle_accuracy(model, policy, episodes, cache=None) -> dict:
    prompts = [[BOS, *e.prompt] for e in episodes]
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=max(len(e.answer) for e in episodes),
        policy=policy,
        stop_tokens=[EOS],
        pad_id=PAD,
        cache=cache or PAGES,
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
    rng = rng_for("needle")
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
        "confkv_int8": (confkv, jaxkv.CacheConfig(page_size=PAGE_SIZE, storage="int8")),
        "snapkv": policies.SnapKV(budget=matched),
        "pyramidkv": policies.PyramidKV(budget=matched),
        "h2o": policies.H2O(budget=matched, recent=s.protected),
        "sliding_window": policies.SlidingWindow(budget=matched),
    }
    for name, policy in others.items():
        policy, cache = policy if isinstance(policy, tuple) else (policy, None)
        results[name] = needle_accuracy(model, policy, episodes, cache=cache)
        log("needle", name, results[name])
    return {"matched_tokens_per_head": matched, "policies": results}


# --- KL premise ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="policy")
def _query_logits(model, kv, tokens, positions, policy):
    hidden, _, _ = forward_cached(model, tokens, positions, kv, policy=policy)
    return logits_from_hidden(model.params, model.config, hidden[:, 0])


def run_kl(model, reading: Reading, s: Settings, log=print) -> dict:
    """Confidence of p_full at each query position vs KL(p_full || p_ablated)."""
    full_policy = policies.FullCache()
    confidences, shifts = [], []
    for row in reading.rows("kl", s.kl_texts, s.kl_length):
        full_logits = forward(model, jnp.asarray(row[None]))[0]  # [T, V]
        queries = np.linspace(s.kl_ablated + 16, len(row) - 1, s.kl_points).astype(int)
        prefixes = [row[: t - s.kl_ablated] for t in queries]  # context without the newest 256
        kv = jaxkv.compress_prompt(
            model,
            [p.tolist() for p in prefixes],
            full_policy,
            cache=PAGES,
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


def _timed_log(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


PARTS = ("kl", "ppl", "needle", "ablation")


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="jaxkv bench confkv",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=str(REFERENCE_MODEL),
        help="a checkpoint directory, a .gguf file or a fetched model's name (default: the "
        "bundled byte-level reference model)",
    )
    parser.add_argument(
        "--text",
        choices=TEXTS,
        help="texts read (default: heldout for a byte-level model, prose otherwise)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--out", type=Path, default=Path("results/confkv"))
    parser.add_argument(
        "--parts",
        default="kl,ppl,needle",
        help=f"comma-separated, of {','.join(PARTS)}; files are named confkv.json for the "
        "default and confkv-<parts>.json otherwise",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=INT", help="override a setting"
    )
    parser.add_argument("--rows", default=None, help="ablation rows (comma-separated; all)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts {args.parts!r}: expected a comma-separated subset of {PARTS}")
    s = with_overrides(QUICK if args.quick else Settings(), args.set)
    model, tokenizer = load_model(args.model, dtype="float32")
    byte_level = is_byte_tokenizer(tokenizer)
    if "needle" in parts and not byte_level:
        raise SystemExit(
            "--parts needle: the needle part is byte-level; use `jaxkv bench real_quality` for "
            f"needles on {args.model}"
        )
    reading = Reading(tokenizer, args.text or ("heldout" if byte_level else "prose"))
    started = time.time()
    report = {**harness.provenance("jaxkv bench confkv", argv), "model": str(args.model)}
    report |= {"model_file_sha256": model_file_sha256(args.model), "text": reading.text}
    report["settings"] = dataclasses.asdict(s)
    if "kl" in parts:
        report["kl"] = run_kl(model, reading, s, log=_timed_log)
    if "ppl" in parts:
        report["ppl"] = run_ppl(model, reading, s, log=_timed_log)
    if "needle" in parts:
        heldout = corpus_lib.load_corpus("heldout")
        report["needle"] = run_needles(model, heldout, s, log=_timed_log)
    if "ablation" in parts:
        rows = args.rows.split(",") if args.rows else None
        report["ablation"] = run_ablation(model, reading, s, rows, log=_timed_log)
    report["seconds"] = time.time() - started
    stem = "confkv" if parts == ["kl", "ppl", "needle"] else "-".join(["confkv", *parts])
    text = table(report)
    harness.save(args.out, stem, report, text, indent=None)  # per-step traces
    if "ppl" in parts:
        prefix = "" if stem == "confkv" else f"{stem}-"
        plot_trace(report["ppl"]["policies"]["confkv"], args.out / f"{prefix}trace.png")
        plot_ppl(report["ppl"], args.out / f"{prefix}ppl_by_length.png")
    print(text)
    return report


if __name__ == "__main__":
    main()
