"""jaxcls: classification with millions of classes in JAX."""

from jaxcls import startup

startup.start_jax()  # before anything imports jax

from jaxcls.mesh import batch_sharding, class_shards, make_mesh, padded_num_classes, weight_sharding  # noqa: E402

__version__ = "0.1.0"
__all__ = ["batch_sharding", "class_shards", "make_mesh", "padded_num_classes", "weight_sharding"]
