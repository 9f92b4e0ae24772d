"""The engine's room: what one chunk or decode step does, for every policy and storage tier.

rows     the per-row state of a decode (`Rows`: budgets, key, step, position, sampler);
parts    the part protocols a policy's record is made of, and what they see
         (`PrefillObservations`, `DecodeContext`);
layer    one layer's attend-then-write step (`attend_and_write`) over a `LayerCache` view;
forward  the model's blocks over the paged state (`forward_cached`), and the cache-free
         `forward` on an attention backend;
decode   the decode step: `read_tokens`, then the policy's decode eviction (`decode_step`),
         then each row's next token (`decode_and_sample`).

Policies (`jaxkv.policies`) import the protocols from here and fill them; generation and the
serving engine call `decode_and_sample` and `forward_cached`. Nothing here imports a policy.
"""
