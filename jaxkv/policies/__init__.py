"""Cache policies (admission, eviction, selection) over the paged KV state."""

from jaxkv.policies.base import FullCache, Policy, get, register, registered

__all__ = ["FullCache", "Policy", "get", "register", "registered"]
