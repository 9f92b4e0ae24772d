"""The decoder shared by Llama 2/3/3.1+, Qwen2/2.5 and Qwen3: pure functions over a params tree.

The families differ only by config flags (q/k/v bias, q/k RMSNorm, RoPE scaling, tied embeddings),
so one implementation serves all of them. Layer parameters are stacked on a leading axis [L, ...]
and the layers run under `lax.scan` (`scan_layers`), which keeps compile time independent of
depth.

The model provides its blocks (projections, RoPE, output projection + MLP, embedding, logits)
and the cache-free `forward`; it knows nothing of the KV cache or of attention kernels: the
cached forward that threads the paged KV state is `jaxkv.step.forward.forward_cached`, and kernel
backends reach `forward` as its `attention_fn` (`jaxkv.step.forward.forward`).

Params layout (D hidden, N query heads, K KV heads, H head dim, F MLP width, V vocab):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied);
  layers: attn_norm [L, D]; wq [L, D, N, H]; wk, wv [L, D, K, H]; wo [L, N, H, D];
          bq [L, N, H], bk, bv [L, K, H] (qkv_bias); q_norm, k_norm [L, H] (qk_norm);
          mlp_norm [L, D]; w_gate, w_up [L, D, F]; w_down [L, F, D].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from jaxkv.models import layers
from jaxkv.models.configs import ModelConfig

Params = dict[str, Any]

# Logical axis names of every parameter (the layout above); a mesh's rules table maps them to
# device axes (`jaxkv.sharding`).
PARAM_AXES: dict[str, Any] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "layers": {
        "attn_norm": ("layers", "embed"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "bq": ("layers", "heads", "head_dim"),
        "bk": ("layers", "kv_heads", "head_dim"),
        "bv": ("layers", "kv_heads", "head_dim"),
        "q_norm": ("layers", "head_dim"),
        "k_norm": ("layers", "head_dim"),
        "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    },
}


class AttentionFn(Protocol):
    """Causal self-attention over whole sequences: q [B, N, T, H], k, v [B, K, T, H] ->
    [B, N, T, H] in q's dtype (`layers.causal_attention`, or a kernel dispatch above models)."""

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float
    ) -> jax.Array: ...


@flax.struct.dataclass
class Model:
    """A configuration with its parameters; a pytree whose only leaves are the params.

    Attributes:
      config: static ModelConfig.
      params: the params pytree (layout in this module's docstring).
    """

    config: ModelConfig = flax.struct.field(pytree_node=False)
    params: Params

    @property
    def dtype(self):
        return self.params["embed"].dtype


def param_shapes(cfg: ModelConfig) -> Params:
    """Shapes of every parameter, in the layout of this module's docstring."""
    d, n, k, h, f, num_layers = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.num_layers,
    )
    stacked = {
        "attn_norm": (d,),
        "wq": (d, n, h),
        "wk": (d, k, h),
        "wv": (d, k, h),
        "wo": (n, h, d),
        "mlp_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }
    if cfg.qkv_bias:
        stacked |= {"bq": (n, h), "bk": (k, h), "bv": (k, h)}
    if cfg.qk_norm:
        stacked |= {"q_norm": (h,), "k_norm": (h,)}
    shapes: Params = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers": {name: (num_layers, *shape) for name, shape in stacked.items()},
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters: normal(0, scale) weights, zero biases, unit norms."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), leaf_key in zip(flat, keys, strict=True):
        name = path[-1].key
        if _is_norm(name):
            leaves.append(jnp.ones(shape, dtype))
        elif name.startswith("b"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((scale * jax.random.normal(leaf_key, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.02) -> Model:
    """A model with random parameters (see `init_params`)."""
    return Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(seed), dtype, scale))


def rope_for(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin for positions [B, T]; padding positions (-1) get an arbitrary but finite rotation."""
    return layers.rope_cos_sin(cfg, jnp.maximum(positions, 0))


def attention_input(lp: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The normed hidden state [B, T, D] the q/k/v projections read."""
    return layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)


def _project_heads(h: jax.Array, w: jax.Array) -> jax.Array:
    """[B, heads, T, H] from h [B, T, D] and w [D, heads, H].

    The product is taken in the weight's own order ([B, T, heads, H]) and the small result
    transposed: asking the dot for [B, heads, T, H] directly makes XLA:CPU copy a transposed
    weight every layer and step, which dominated small decode steps."""
    return jnp.einsum("btd,dnh->btnh", h, w).transpose(0, 2, 1, 3)


def project_unrotated_queries(lp: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Queries before RoPE (after Qwen3's q_norm) [B, N, T, H] from h [B, T, D]."""
    q = _project_heads(h, lp["wq"])
    if cfg.qkv_bias:
        q = q + lp["bq"][:, None]
    if cfg.qk_norm:
        q = layers.rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    return q


def project_queries(lp: Params, cfg: ModelConfig, h: jax.Array, cos, sin) -> jax.Array:
    """Rotated queries [B, N, T, H] from attention inputs h [B, T, D]."""
    return layers.apply_rope(project_unrotated_queries(lp, cfg, h), cos, sin)


def project_unrotated_keys_values(lp: Params, cfg: ModelConfig, h: jax.Array):
    """Keys before RoPE (after Qwen3's k_norm) and values [B, K, T, H] from h [B, T, D]."""
    k = _project_heads(h, lp["wk"])
    v = _project_heads(h, lp["wv"])
    if cfg.qkv_bias:
        k = k + lp["bk"][:, None]
        v = v + lp["bv"][:, None]
    if cfg.qk_norm:
        k = layers.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return k, v


def project_keys_values(lp: Params, cfg: ModelConfig, h: jax.Array, cos, sin):
    """Rotated keys and values [B, K, T, H] from attention inputs h [B, T, D]."""
    k, v = project_unrotated_keys_values(lp, cfg, h)
    return layers.apply_rope(k, cos, sin), v


def attention_inputs(lp: Params, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """q [B, N, T, H], k, v [B, K, T, H] (q and k rotated) from the residual stream x [B, T, D]."""
    h = attention_input(lp, cfg, x)
    return (project_queries(lp, cfg, h, cos, sin), *project_keys_values(lp, cfg, h, cos, sin))


def attention_output_and_mlp(
    lp: Params,
    cfg: ModelConfig,
    x: jax.Array,
    attn: jax.Array,
    reduce_partial_sums: Callable[[jax.Array], jax.Array] | None = None,
):
    """Output projection of attn [B, N, T, H], residual add, then the MLP block; returns x.

    reduce_partial_sums: with tensor parallelism (a device holding some heads and MLP columns),
      sums the output projection's and the MLP's partial products over the devices; None on one
      device.
    """
    x = attention_residual(lp, x, attn, reduce_partial_sums)
    return mlp_residual(lp, cfg, x, reduce_partial_sums)


def attention_residual(lp: Params, x: jax.Array, attn: jax.Array, reduce_partial_sums=None):
    """x [B, T, D] plus the output projection of attn [B, N, T, H] (`attention_output_and_mlp`'s
    first half: the residual stream the MLP reads)."""
    reduce = reduce_partial_sums or (lambda y: y)
    heads_last = attn.astype(x.dtype).transpose(0, 2, 1, 3)  # [B, T, N, H]: see _project_heads
    return x + reduce(jnp.einsum("btnh,nhd->btd", heads_last, lp["wo"]))


def mlp_residual(lp: Params, cfg: ModelConfig, x: jax.Array, reduce_partial_sums=None):
    """x [B, T, D] plus the MLP block of its norm (`attention_output_and_mlp`'s second half)."""
    reduce = reduce_partial_sums or (lambda y: y)
    h = layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    return x + reduce(layers.swiglu_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"]))


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def final_hidden(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """f32 logits [..., V] from final-normed hidden states [..., D]."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)


def scan_layers(
    layer: Callable[[Any, Params, Any], tuple[Any, Any]],
    carry: Any,
    layer_params: Params,
    per_layer: Any = None,
    *,
    remat: bool = False,
) -> tuple[Any, Any]:
    """Runs `layer(carry, lp, xs) -> (carry, y)` over the stacked layers under `lax.scan`.

    layer_params: the params' "layers" subtree (leaves [L, ...]); `lp` is one layer's slice.
    per_layer: any pytree with leaves [L, ...] sliced alongside (`xs`; None when absent).
    remat: recompute each layer's activations in the backward pass instead of storing them.
    Returns the final carry and the per-layer outputs stacked [L, ...].
    """

    def step(carry, xs):
        lp, layer_xs = xs
        return layer(carry, lp, layer_xs)

    if remat:
        step = jax.checkpoint(step)
    return jax.lax.scan(step, carry, (layer_params, per_layer))


def forward(
    model: Model,
    tokens: jax.Array,
    *,
    attention_fn: AttentionFn = layers.causal_attention,
    remat: bool = False,
) -> jax.Array:
    """Causal forward over whole sequences without a cache: logits [B, T, V] (f32).

    attention_fn: the causal self-attention every layer runs (plain jnp by default; kernel
      backends through `jaxkv.step.forward.forward`).
    remat: recompute each layer's activations in the backward pass instead of storing them
      (training at long context).
    """
    cfg, params = model.config, model.params
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_for(cfg, positions)

    def layer(x, lp, _):
        q, k, v = attention_inputs(lp, cfg, x, cos, sin)
        attn = attention_fn(q, k, v, sm_scale=cfg.head_dim**-0.5)
        return attention_output_and_mlp(lp, cfg, x, attn), None

    x, _ = scan_layers(layer, embed(params, tokens), params["layers"], remat=remat)
    return logits_from_hidden(params, cfg, final_hidden(params, cfg, x))
