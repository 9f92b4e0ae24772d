"""The engine's room: what one chunk or decode step does, for every policy and storage tier.

parts    the part protocols a policy's record is made of, and what they see
         (`PrefillObservations`, `DecodeContext`);
layer    one layer's attend-then-write step (`attend_and_write`) over a `LayerCache` view;
forward  the model's blocks over the paged state (`forward_cached`), and the cache-free
         `forward` on an attention backend;
decode   the decode step: `read_tokens`, then the policy's decode eviction (`decode_step`).

Policies (`jaxkv.policies`) import the protocols from here and fill them; generation and the
serving engine call `decode_step` and `forward_cached`. Nothing here imports a policy.
"""
