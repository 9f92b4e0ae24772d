"""Plain-numpy versions of each eviction algorithm, written from the papers / kvpress semantics.

They read a Hugging Face forward pass (attention probabilities, keys, hidden states) of ONE prompt,
so they share nothing with the project's paged implementation. Each returns, per layer, a keep
mask [K, T] over positions and the scores that ranked them (None when no ranking applies).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import torch


@dataclasses.dataclass
class Forward:
    """One prompt through a transformers model: per layer attention [N, T, T], keys and values
    [K, T, H], attention inputs [T, D] (input_layernorm of the layer's input), and the model."""

    attentions: list[np.ndarray]
    keys: list[np.ndarray]
    attention_inputs: list[np.ndarray]
    model: torch.nn.Module
    values: list[np.ndarray] | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[0]

    @property
    def group(self) -> int:
        return self.attentions[0].shape[0] // self.num_kv_heads


def run(model, prompt) -> Forward:
    with torch.no_grad():
        out = model(
            torch.as_tensor([prompt]),
            output_attentions=True,
            output_hidden_states=True,
            use_cache=True,
        )
        layers = model.model.layers
        inputs = [
            layers[i].input_layernorm(out.hidden_states[i])[0].double().numpy()
            for i in range(len(layers))
        ]
    return Forward(
        attentions=[a[0].double().numpy() for a in out.attentions],
        keys=[layer.keys[0].double().numpy() for layer in out.past_key_values.layers],
        attention_inputs=inputs,
        model=model,
        values=[layer.values[0].double().numpy() for layer in out.past_key_values.layers],
    )


def top_per_head(scores: np.ndarray, budget: int) -> np.ndarray:
    """keep [K, T]: the `budget` best scores of each row (stable: earlier position on ties)."""
    keep = np.zeros(scores.shape, bool)
    for row, head_scores in enumerate(scores):
        keep[row, np.argsort(-head_scores, kind="stable")[:budget]] = True
    return keep


def group_mean(per_query_head: np.ndarray, num_kv_heads: int) -> np.ndarray:
    n, t = per_query_head.shape
    return per_query_head.reshape(num_kv_heads, n // num_kv_heads, t).mean(axis=1)


def snapkv_scores(attn, num_kv_heads, window, kernel):
    """[K, T]: window attention of the last `window` queries, pooled, group-averaged; the
    window itself scores +inf."""
    t = attn.shape[-1]
    mean = attn[:, t - window :, : t - window].mean(axis=1)
    pooled = np.stack([np.convolve(row, np.ones(kernel), mode="same") / kernel for row in mean])
    scores = group_mean(pooled, num_kv_heads)
    return np.concatenate([scores, np.full((num_kv_heads, window), np.inf)], axis=1)


def snapkv(fwd: Forward, budget: int, window: int = 64, kernel: int = 5):
    out = []
    for attn in fwd.attentions:
        scores = snapkv_scores(attn, fwd.num_kv_heads, window, kernel)
        out.append((top_per_head(scores, budget), scores))
    return out


def pyramid_budgets(
    budget: float, kept: int, length: int, num_layers: int, window: int, beta: float
):
    """kvpress PyramidKV's per-layer budgets: `budget` q_len (1 - compression_ratio) unrounded,
    `kept` in every layer where no pyramid fits."""
    min_num = budget / beta
    max_num = 2 * budget - min_num
    if max_num >= length - window:
        max_num = length - window
        min_num = 2 * budget - max_num
    if not (length >= max_num >= min_num >= window):
        return [kept] * num_layers
    steps = (max_num - min_num) / (num_layers - 1)
    return [round(max_num - layer * steps) for layer in range(num_layers)]


def pyramidkv(fwd: Forward, budget: int, window: int, beta: float = 20.0, share=None):
    """`share`: the budget as a share of the prompt (kvpress's 1 - compression_ratio), whose
    unrounded product with its length the layer budgets read; None: `budget` tokens."""
    t = fwd.attentions[0].shape[-1]
    exact = budget if share is None else share * t
    kept = budget if share is None else max(1, round(exact))
    budgets = pyramid_budgets(exact, kept, t, len(fwd.attentions), window, beta)
    out = []
    for attn, layer_budget in zip(fwd.attentions, budgets, strict=True):
        scores = snapkv_scores(attn, fwd.num_kv_heads, window, 5)
        out.append((top_per_head(scores, layer_budget), scores))
    return out


def tova(fwd: Forward, budget: int):
    out = []
    for attn in fwd.attentions:
        last = attn[:, -1, :].mean(axis=0)
        last[-1] = np.inf
        scores = np.broadcast_to(last, (fwd.num_kv_heads, last.shape[0]))
        out.append((top_per_head(scores, budget), scores))
    return out


def knorm(fwd: Forward, budget: int):
    return [
        (top_per_head(-np.linalg.norm(k, axis=-1), budget), -np.linalg.norm(k, axis=-1))
        for k in fwd.keys
    ]


def h2o(fwd: Forward, budget: int, observed: bool = False):
    out = []
    for attn in fwd.attentions:
        received = group_mean(attn.sum(axis=1), fwd.num_kv_heads)  # summed over all queries
        if observed:
            t = received.shape[-1]
            received = received / (t - np.arange(t))
        out.append((top_per_head(received, budget), received))
    return out


def streaming_llm(fwd: Forward, budget: int, sinks: int = 4):
    t = fwd.attentions[0].shape[-1]
    keep = (np.arange(t) < sinks) | (np.arange(t) >= t - (budget - sinks))
    return [(np.broadcast_to(keep, (fwd.num_kv_heads, t)), None) for _ in fwd.attentions]


def adakv(layer_scores, budget: int, safeguard: float = 0.2):
    """AdaKV over per-layer scores [K, T]: each head's best budget x safeguard, then the layer's
    best K x budget across its heads."""
    out = []
    for scores in layer_scores:
        forced = top_per_head(scores, int(np.floor(budget * safeguard)))
        ranked = np.where(forced, np.inf, scores)
        k, t = scores.shape
        keep = np.zeros(k * t, bool)
        keep[np.argsort(-ranked.reshape(-1), kind="stable")[: k * budget]] = True
        out.append((keep.reshape(k, t), scores))
    return out


def adakv_snapkv(fwd: Forward, budget: int, window: int, safeguard: float = 0.2):
    return adakv([snapkv_scores(a, fwd.num_kv_heads, window, 5) for a in fwd.attentions], budget)


def adakv_expected_attention(fwd: Forward, budget: int, future_positions: int):
    scored = expected_attention(fwd, budget, future_positions=future_positions)
    return adakv([scores for _, scores in scored], budget)


def sage_split(budget: int, group: int) -> tuple[int, int, int]:
    """SAGE-KV appendix A.2: B/4 sinks; k = B/(2G) per query head, rounded down to a power of
    two as the paper does for Qwen2.5 (B = 8192, G = 7: 585 -> 512); the rest is recent."""
    sinks = budget // 4
    half = budget // (2 * group)
    per_head = 2 ** int(np.floor(np.log2(half))) if half >= 1 else 0
    return sinks, per_head, budget - sinks - group * per_head


def sage_kv(fwd: Forward, budget: int):
    group = fwd.group
    sinks, per_head, recent = sage_split(budget, group)
    out = []
    for attn in fwd.attentions:
        t = attn.shape[-1]
        last = attn[:, -1, :]  # [N, T]
        candidate = (np.arange(t) >= sinks) & (np.arange(t) < t - recent)
        keep = np.broadcast_to(
            (np.arange(t) < sinks) | (np.arange(t) >= t - recent), (fwd.num_kv_heads, t)
        ).copy()
        for head in range(last.shape[0]):
            ranked = np.where(candidate, last[head], -np.inf)
            keep[head // group, np.argsort(-ranked, kind="stable")[:per_head]] = True
        scores = np.repeat(last, 1, axis=0)
        out.append((keep, group_mean(scores, fwd.num_kv_heads)))
    return out


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def gvote(
    fwd: Forward,
    key,
    batch_index: int,
    nucleus=0.95,
    num_samples=8,
    future_positions=16,
):
    """The paper's Algorithm 1 (listing) with the model's q-projection and RoPE layout. The
    Gaussian noise is drawn with the same jax key so that both sides vote with the same samples.
    """
    model = fwd.model
    head_dim, group = fwd.keys[0].shape[-1], fwd.group
    t = fwd.attentions[0].shape[-1]
    with torch.no_grad():
        positions = torch.arange(t, t + future_positions)[None]
        dummy = torch.zeros(1, future_positions, head_dim)
        cos, sin = model.model.rotary_emb(dummy, positions)
    cos, sin = cos[0].double().numpy().mean(0), sin[0].double().numpy().mean(0)
    out = []
    for layer, (attn, keys, h) in enumerate(
        zip(fwd.attentions, fwd.keys, fwd.attention_inputs, strict=True)
    ):
        last = attn[:, -1, :]
        sorted_last = -np.sort(-last, axis=-1)
        step_budget = np.sum(np.cumsum(sorted_last, axis=-1) < nucleus, axis=-1) + 1
        mu, std = h.mean(axis=0), h.std(axis=0, ddof=1)
        row_key = jax.random.fold_in(jax.random.fold_in(key, layer), batch_index)
        noise = np.asarray(jax.random.normal(row_key, (num_samples, h.shape[1])))
        sampled = mu + std * noise
        attn_module = model.model.layers[layer].self_attn
        w = attn_module.q_proj.weight.detach().double().numpy()
        q = sampled @ w.T
        if attn_module.q_proj.bias is not None:
            q = q + attn_module.q_proj.bias.detach().double().numpy()
        q = q.reshape(num_samples, -1, head_dim).transpose(1, 0, 2)  # [N, S, H]
        q = q * cos + _rotate_half(q) * sin
        keep = np.zeros((fwd.num_kv_heads, t), bool)
        for head in range(q.shape[0]):
            logits = q[head] @ keys[head // group].T  # [S, T]
            for sample in range(num_samples):
                chosen = np.argsort(-logits[sample], kind="stable")[: step_budget[head]]
                keep[head // group, chosen] = True
        out.append((keep, None))
    return out


def expected_attention(fwd: Forward, budget: int, sinks: int = 4, future_positions: int = 512):
    """kvpress's ExpectedAttentionPress as its docstring states it: per query head, the mean and
    covariance of the pre-RoPE queries past the sinks, rotated by RoPE averaged over the next
    `future_positions` positions; score exp-term mu.k / sqrt(d) + k S k / 2d, softmaxed over
    the keys past the sinks, averaged over the group, times the value norm; sinks kept."""
    model = fwd.model
    head_dim, group = fwd.keys[0].shape[-1], fwd.group
    t = fwd.keys[0].shape[1]
    with torch.no_grad():
        positions = torch.arange(t, t + future_positions)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, future_positions, head_dim), positions)
    cos, sin = cos[0].double().numpy().mean(0), sin[0].double().numpy().mean(0)
    half = head_dim // 2
    rotate_half = np.zeros((head_dim, head_dim))
    rotate_half[:half, half:], rotate_half[half:, :half] = -np.eye(half), np.eye(half)
    rotation = np.diag(cos) + sin[:, None] * rotate_half
    out = []
    for layer, (keys, values, h) in enumerate(
        zip(fwd.keys, fwd.values, fwd.attention_inputs, strict=True)
    ):
        q_proj = model.model.layers[layer].self_attn.q_proj
        q = h[sinks:] @ q_proj.weight.detach().double().numpy().T
        if q_proj.bias is not None:
            q = q + q_proj.bias.detach().double().numpy()
        q = q.reshape(t - sinks, -1, head_dim).transpose(1, 0, 2)  # [N, T - sinks, H]
        per_query_head = []
        for head in range(q.shape[0]):
            mean = q[head].mean(0)
            covariance = (q[head] - mean).T @ (q[head] - mean) / (t - sinks)
            mean, covariance = rotation @ mean, rotation @ covariance @ rotation.T
            k = keys[head // group, sinks:]
            logits = k @ mean / np.sqrt(head_dim)
            logits += np.einsum("ti,ij,tj->t", k, covariance, k) / head_dim / 2
            probs = np.exp(logits - logits.max())
            per_query_head.append(probs / probs.sum())
        scores = group_mean(np.stack(per_query_head), fwd.num_kv_heads)
        scores = scores * np.linalg.norm(values[:, sinks:], axis=-1)
        scores = np.concatenate([np.full((scores.shape[0], sinks), np.inf), scores], axis=1)
        out.append((top_per_head(scores, budget), scores))
    return out
