"""Eight CPU devices for every test, so meshes like (data=2, class=4) really run."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 CPU devices: import jax only after conftest sets XLA_FLAGS"

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.fixture
def rng(request):
    """A generator with a fresh seed per test; the seed is in the test's report for replay."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
