"""jaxcls: classification with millions of classes in JAX."""

from jaxcls.mesh import batch_sharding, make_mesh

__version__ = "0.1.0"
__all__ = ["batch_sharding", "make_mesh"]
