import jax
import pytest


@pytest.fixture
def full_precision_references():
    """XLA's f32 matmuls default to tf32 on a GPU and bf16 passes on a TPU; the references the
    kernels meet must not."""
    with jax.default_matmul_precision("highest"):
        yield
