"""Learned gates of the admission/eviction policies, as pure functions over separate param trees.

Gate parameters never live in the backbone's params: each gate module stacks its per-layer
weights on a leading [L] axis, so the decoder's layer scan hands layer l's slice to
the policy's gate part, `write_scores` (through `generate(..., policy_params=...)`).
"""
