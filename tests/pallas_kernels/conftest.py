import jax
import pytest


@pytest.fixture
def full_precision_references():
    """XLA's f32 matmuls on a GPU default to tf32; the references the kernels meet must not."""
    with jax.default_matmul_precision("highest"):
        yield
