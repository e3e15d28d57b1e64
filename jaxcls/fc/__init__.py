"""The FC head: a class-sharded weight with its PartialFC sampling, its loss and its sparse row optimizers, fused
tile by tile (``FCHead.step``)."""

from jaxcls.fc.head import DEFAULT_CHUNK, FCHead

__all__ = ["DEFAULT_CHUNK", "FCHead"]
