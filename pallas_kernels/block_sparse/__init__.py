"""The block-sparse causal prefill attention kernel."""
