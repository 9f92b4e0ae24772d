"""Sessions saved to a directory and loaded by another process: a compressed document reused.

    policy = policies.from_spec("kvzip:0.3").for_tokenizer(tokenizer)
    save_session(prefill(model, context_ids, policy), "doc.session")
    session = load_session("doc.session", model, policy)   # in another process

The directory holds the session's arrays (an orbax checkpoint: the KV state, lengths, last
hidden states, budgets, the policy's parameters) and `session.json`: what they were made with.
The KV state is saved with its held pages only (`repack` into a pool of that many pages, the
page tables renumbered); loading gives it back its pool's free pages, so the loaded session
reads on, forks and decodes as the saved one. Loading checks the model (its configuration and
a digest of its parameters) and the policy against that record and refuses a mismatch by name:
a session only means something with the model and policy that wrote it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv.attention import Backend
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig
from jaxkv.cache.int8 import create_tier
from jaxkv.cache.repack import grow
from jaxkv.generation.loop import repack_program
from jaxkv.generation.session import Session
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy, from_spec

FORMAT = 2  # 2: the held pages only (and the int8 tier's pool size, where it has one)
RECORD = "session.json"
ARRAYS = "arrays"


def model_digest(model: Model) -> str:
    """sha256 over the model's configuration and every parameter's dtype, shape and bytes."""
    digest = hashlib.sha256(repr(model.config).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.params):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def held_pages_only(kv: KVState) -> KVState:
    """`kv` in a pool of the pages it holds (at least one), renumbered in table order; its
    int8 tier, if any, likewise."""
    tier = kv.pool.int8
    int8_geometry = None
    if tier is not None:
        int8_geometry = (max(int(tier.pages_in_use()), 1), tier.page_table.shape[-1])
    return repack_program(
        None,
        kv=kv,
        num_pages=max(int(kv.pages_in_use()), 1),
        max_pages=kv.page_table.shape[-1],
        int8_geometry=int8_geometry,
    )


def policy_fields(value, path: str = "") -> dict[str, str]:
    """A policy's fields by path ("ratio", "policies[1].budget.ratio"), each as its repr, and
    each record's class at its own path ("" the policy's): what tells two policies apart."""
    if dataclasses.is_dataclass(value):
        prefix = f"{path}." if path else ""
        own = {path: type(value).__name__}
        settings = (f.name for f in dataclasses.fields(value) if f.init)  # a policy's parts are not
        parts = {prefix + name: getattr(value, name) for name in settings}
    elif isinstance(value, tuple) and any(map(dataclasses.is_dataclass, value)):
        own, parts = {}, {f"{path}[{i}]": item for i, item in enumerate(value)}
    else:
        return {path: repr(value)}
    nested = (policy_fields(item, name) for name, item in parts.items())
    return own | {key: text for fields in nested for key, text in fields.items()}


def policy_difference(saved: dict[str, str], given: dict[str, str]) -> str | None:
    """How a policy differs from the saved one, from both's `policy_fields`, in words: its
    class, else the fields that differ (with both values where they are short); None when
    nothing does."""
    if saved[""] != given[""]:
        return f"policy {saved['']}, not {given['']}"
    differing = [key for key in {**saved, **given} if saved.get(key) != given.get(key)]
    if not differing:
        return None
    changes = ", ".join(_change(key, saved.get(key), given.get(key)) for key in differing)
    return f"another {saved['']} policy: {changes} differ{'s' if len(differing) == 1 else ''}"


def _change(key: str, saved: str | None, given: str | None) -> str:
    if max(len(str(saved)), len(str(given))) > 24:  # token tuples: the name says enough
        return key
    return f"{key} (saved {saved}, given {given})"


def _arrays(session: Session) -> dict:
    return {
        "kv": flax.serialization.to_state_dict(held_pages_only(session.kv)),
        "last_hidden": np.asarray(session.last_hidden),
        "lengths": np.asarray(session.lengths),
        "budget_tokens": np.asarray(session.budget_tokens),
        "budget_ratio": np.asarray(session.budget_ratio),
        "policy_params": flax.serialization.to_state_dict(session.policy_params),
    }


def save_session(session: Session, path: str | Path) -> Path:
    """Writes the session to the directory `path` (which must not exist yet); returns it."""
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"path={str(path)!r} exists: give a new directory")
    if session.placement is not None:
        raise ValueError("saving a session on a mesh is not supported: prefill on one device")
    session.kv.check()
    tier = session.kv.pool.int8
    path.mkdir(parents=True)
    ocp.PyTreeCheckpointer().save(path / ARRAYS, _arrays(session))
    record = {
        "format": FORMAT,
        "model": model_digest(session.model),
        "model_config": repr(session.model.config),
        "policy": repr(session.policy),
        "policy_fields": policy_fields(session.policy),
        "pool_pages": session.kv.pool.num_pages,
        "int8_pool_pages": None if tier is None else tier.pool.num_pages,
        "cache": _cache_record(session.cache),
        "backend": session.backend.value,
        "shared": session.shared,
        "key_bounds": session.kv.pool.key_min is not None,
        "local_window": 0 if session.kv.ring is None else session.kv.ring.window,
    }
    (path / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return path


def _cache_record(cache: CacheConfig) -> dict:
    """The `CacheConfig`'s fields as JSON values (`CacheConfig(**record)` rebuilds it)."""
    return {
        "page_size": cache.page_size,
        "num_pages": cache.num_pages,
        "kv_dtype": None if cache.kv_dtype is None else cache.kv_dtype.name,
        "storage": cache.storage.value,
        "full_precision_window": cache.full_precision_window,
    }


def _record(path: Path) -> dict:
    file = path / RECORD
    if not file.is_file():
        raise ValueError(f"{str(path)!r} holds no saved session (no {RECORD})")
    record = json.loads(file.read_text())
    if record.get("format") != FORMAT:
        raise ValueError(
            f"{str(file)!r} is format {record.get('format')}; this jaxkv reads format {FORMAT}"
        )
    return record


def _empty_state(arrays: dict, record: dict) -> KVState:
    """A KV state of the saved structure (filled by `from_state_dict`)."""
    pool, table = arrays["kv"]["pool"], arrays["kv"]["page_table"]
    num_pages, page_size, head_dim = pool["k_pages"].shape
    num_layers, batch, num_kv_heads, max_pages = table.shape
    kv = KVState.create(
        num_layers=num_layers,
        batch=batch,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_tokens=max_pages * page_size,
        page_size=page_size,
        num_pages=num_pages,
        dtype=pool["k_pages"].dtype,
        key_bounds=record["key_bounds"],
        local_window=record["local_window"],
    )
    tier = pool.get("int8")
    if tier is None:
        return kv
    window = record["cache"]["full_precision_window"]
    tier = create_tier(kv, window, tier["pool"]["k_pages"].shape[0], tier["page_table"].shape[-1])
    return dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, int8=tier))


def load_session(path: str | Path, model: Model, policy: Policy | str) -> Session:
    """The session saved at `path`, for `model` and `policy` (or its spec): both must be the
    ones it was saved with (ValueError naming what differs). A policy fitted to a tokenizer
    at prefill (KVzip's repeat prompt: `policy.for_tokenizer(tokenizer)`) is given fitted."""
    path = Path(path).absolute()
    record = _record(path)
    policy = from_spec(policy) if isinstance(policy, str) else policy
    if repr(model.config) != record["model_config"] or model_digest(model) != record["model"]:
        raise ValueError(
            f"the session at {str(path)!r} was saved with another model (config "
            f"{record['model_config']}); load it with that model"
        )
    difference = policy_difference(record["policy_fields"], policy_fields(policy))
    if difference is not None:
        raise ValueError(
            f"the session at {str(path)!r} was saved with {difference}; load it with the "
            "policy it was saved with (fitted to the model's tokenizer if it was at prefill: "
            "policy.for_tokenizer(tokenizer))"
        )
    arrays = ocp.PyTreeCheckpointer().restore(path / ARRAYS)
    kv = flax.serialization.from_state_dict(_empty_state(arrays, record), arrays["kv"])
    kv = grow(jax.tree.map(jnp.asarray, kv), record["pool_pages"], record.get("int8_pool_pages"))
    params = arrays.get("policy_params")
    if params is not None and policy.params is not None:
        template = policy.params.init(model.config, jax.random.PRNGKey(0))
        params = flax.serialization.from_state_dict(template, params)
    params = jax.tree.map(jnp.asarray, params)
    return Session(
        model=model,
        kv=kv,
        last_hidden=jnp.asarray(arrays["last_hidden"]),
        lengths=np.asarray(arrays["lengths"], np.int32),
        budget_tokens=np.asarray(arrays["budget_tokens"], np.int32),
        budget_ratio=np.asarray(arrays["budget_ratio"], np.float32),
        # The policy's own fields (the saved one's, checked above).
        thresholds=policy.thresholds(len(arrays["lengths"])),
        policy_params=params,
        policy=policy,
        cache=CacheConfig(**record["cache"]),
        backend=Backend(record["backend"]),
        shared=record["shared"],
    )
