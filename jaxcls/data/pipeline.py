"""The training input pipeline on Grain: shard per host, shuffle per epoch, decode, flip, batch, prefetch.

Batches are uint8 images ``[B_host, S, S, 3]`` and int32 labels; normalization ``(x/255 − 0.5)/0.5``
happens on the device inside the train step (``normalize``), so a quarter of the bytes cross to the
device. The Grain iterator's state (a position) is saved with every checkpoint, so a resumed run
continues with exactly the next batch.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from PIL import Image

from jaxcls.data.recordio import decode_image


def to_image(data, size: int) -> np.ndarray:
    """Encoded bytes or an array → uint8 ``[size, size, 3]`` RGB (bilinear resize when needed)."""
    image = decode_image(data) if isinstance(data, (bytes, bytearray)) else np.asarray(data, np.uint8)
    if image.shape[:2] != (size, size):
        image = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))
    return image


def normalize(images: jax.Array) -> jax.Array:
    """uint8 → float32 in [-1, 1]: ``(x/255 − 0.5)/0.5``, as arcface_torch."""
    return images.astype(jnp.float32) * (2.0 / 255.0) - 1.0


class _Decode:
    """Grain random map: decode, resize, random horizontal flip."""

    def __init__(self, source, size: int, flip: bool):
        self.source, self.size, self.flip = source, size, flip

    def __call__(self, index, rng: np.random.Generator):
        data, label = self.source.raw(int(index))
        image = to_image(data, self.size)
        if self.flip and rng.random() < 0.5:
            image = image[:, ::-1]
        return np.ascontiguousarray(image), np.int32(label)


def train_batches(source, *, batch_size: int, size: int, seed: int, flip: bool = True, workers: int = 0,
                  threads: int = 8, process_index: int | None = None, process_count: int | None = None):
    """An endless, checkpointable Grain iterator of ``(uint8 images, int32 labels)`` host batches.

    ``batch_size`` is this host's share of the global batch; each host reads every
    ``process_count``-th image starting at ``process_index``. ``workers > 0`` decodes in that many
    processes, else in ``threads`` threads.
    """
    import grain

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    indices = grain.MapDataset.range(len(source))[process_index::process_count]
    ds = (indices.shuffle(seed=seed).repeat(None)
          .random_map(_Decode(source, size, flip), seed=seed + 1)
          .batch(batch_size, drop_remainder=True))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * batch_size))
    if workers > 0:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(it)


def device_batch(host_batch, sharding):
    """Place this host's part of the global batch on the mesh (``jax.make_array_from_process_local_data``)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host_batch)
