"""The training input pipeline on Grain: one global stream, each host decoding its rows of every global batch.

The image indices are shuffled anew each epoch with the seed into one global stream, cut into global
batches; a host decodes, flips and batches only its rows of each (the rows its devices hold in the batch
sharding), with prefetch. Batches are uint8 images ``[B_host, S, S, 3]`` and int32 labels; normalization
``(x/255 − 0.5)/0.5`` happens on the device inside the train step (``normalize``), so a quarter of the bytes
cross to the device. The position saved with every checkpoint counts global batches, so a resumed run
continues with exactly the next batch on any number of hosts.

A record that cannot be read or decoded, or whose label is outside the FC's classes, raises ``DataError`` naming
it (policy ``"error"``), or (``"skip"``) is replaced by the next good record of the source (index + 1, + 2, …: the
same on any host count and after a resume), listed in a log file and counted in ``HostBatches.bad_records``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jaxcls.data.recordio import DataError, decode_image

BAD_RECORDS = ("error", "skip")
MAX_BAD_IN_A_ROW = 100  # with "skip": this many bad records in a row mean the data set is broken


def to_image(data, size: int, where: str = "image") -> np.ndarray:
    """Encoded bytes or an array → uint8 ``[size, size, 3]`` RGB (bilinear resize when needed)."""
    image = decode_image(data, where) if isinstance(data, (bytes, bytearray)) else np.asarray(data, np.uint8)
    if image.shape[:2] != (size, size):
        image = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))
    return image


def normalize(images: jax.Array) -> jax.Array:
    """uint8 → float32 in [-1, 1]: ``(x/255 − 0.5)/0.5``, as arcface_torch."""
    return images.astype(jnp.float32) * (2.0 / 255.0) - 1.0


class _HostRows:
    """Grain source of ``(global position, image index)`` for this host's rows of every global batch.

    Global position ``g`` is the ``g``-th image of the one global stream (the image indices shuffled anew each
    epoch with the seed); global batch ``b`` holds positions ``b·G … b·G + G − 1`` and this host takes rows
    ``start … stop − 1`` of each, beginning at global batch ``first``. Nothing here depends on the number of
    hosts, so the batches are the same on 1 process or many.
    """

    def __init__(self, order, global_batch: int, rows: tuple[int, int], first: int):
        self.order, self.global_batch, self.rows, self.first = order, global_batch, rows, first

    def __len__(self):
        # endless in practice: the order repeats to 2**63 − 1 images
        return (len(self.order) // self.global_batch - self.first) * (self.rows[1] - self.rows[0])

    def __getitem__(self, k):
        local = self.rows[1] - self.rows[0]
        position = (self.first + k // local) * self.global_batch + self.rows[0] + k % local
        return position, self.order[position]


class _Decode:
    """Grain map: ``(position, index) -> (image, label, records skipped)``: read, decode, check the label, resize,
    and flip with a coin drawn from the seed and the global position; with ``skip``, a bad record is replaced by the
    next good one in the source and its error appended to ``log``."""

    def __init__(self, source, size: int, flip: bool, seed: int, num_classes: int | None, skip: bool,
                 log: str | None):
        self.source, self.size, self.flip, self.seed = source, size, flip, seed
        self.num_classes, self.skip, self.log = num_classes, skip, log

    def _load(self, index: int):
        where = self.source.where(index)
        data, label = self.source.raw(index)
        image = to_image(data, self.size, where)
        if self.num_classes is not None and not 0 <= label < self.num_classes:
            raise DataError(f"label {label} of {where} is outside [0, {self.num_classes})")
        return image, label

    def __call__(self, element):
        position, index = element
        for skipped in range(MAX_BAD_IN_A_ROW):
            try:
                image, label = self._load((int(index) + skipped) % len(self.source))
                break
            except DataError as e:
                if not self.skip:
                    raise
                if self.log:
                    with open(self.log, "a") as f:
                        f.write(str(e).replace("\n", " ") + "\n")
        else:
            raise DataError(f"{MAX_BAD_IN_A_ROW} bad records in a row from {self.source.where(int(index))} on: "
                            "the data set is broken")
        if self.flip and np.random.default_rng((self.seed, position)).random() < 0.5:
            image = image[:, ::-1]
        return np.ascontiguousarray(image), np.int32(label), np.int32(skipped)


class HostBatches:
    """An endless iterator of this host's ``(uint8 images [rows, S, S, 3], int32 labels [rows])`` training batches.

    Its state is the number of *global* batches consumed: the same on every host and for any host count,
    so a run checkpointed on 2 processes resumes on 1 (or 8) with exactly the next global batch.
    ``workers > 0`` decodes in that many processes, else in ``threads`` threads. Labels are checked against
    ``num_classes`` when given. ``bad_records``: ``"error"`` raises the ``DataError`` of a bad record from ``next``;
    ``"skip"`` replaces it (see the module) and appends its error to the file ``bad_records_log`` when decoded (which
    runs ahead of ``next``: a record may be listed before its batch is taken, or twice across a resume);
    ``self.bad_records`` counts the records skipped in the batches this iterator returned since it was made or
    ``set_state``.
    """

    def __init__(self, source, *, global_batch: int, rows: tuple[int, int], size: int, seed: int, flip: bool = True,
                 workers: int = 0, threads: int = 8, num_classes: int | None = None, bad_records: str = "error",
                 bad_records_log: str | None = None):
        if not 0 <= rows[0] < rows[1] <= global_batch:
            raise ValueError(f"host rows {rows} are not a part of a global batch of {global_batch}")
        if bad_records not in BAD_RECORDS:
            raise ValueError(f"unknown bad_records policy {bad_records!r}: choose error or skip")
        self.source, self.global_batch, self.rows = source, global_batch, rows
        self.size, self.seed, self.flip, self.workers, self.threads = size, seed, flip, workers, threads
        self._decode = _Decode(source, size, flip, seed, num_classes, bad_records == "skip",
                               None if bad_records_log is None else str(bad_records_log))
        self.set_state({"global_batches": 0})

    def __iter__(self):
        return self

    def __next__(self):
        images, labels, skipped = next(self.iterator)
        self.consumed += 1
        self.bad_records += int(skipped.sum())
        return images, labels

    def get_state(self) -> dict:
        return {"global_batches": self.consumed}

    def set_state(self, state: dict) -> None:
        """Continue after ``state['global_batches']`` global batches."""
        import grain

        if "global_batches" not in state:
            raise ValueError(f"data position {state} was saved by an older jaxcls (a per-host position); "
                             "it cannot be continued exactly: start the run afresh")
        self.consumed, self.bad_records = int(state["global_batches"]), 0
        order = grain.MapDataset.range(len(self.source)).shuffle(seed=self.seed).repeat(None)
        rows = _HostRows(order, self.global_batch, self.rows, self.consumed)
        local = self.rows[1] - self.rows[0]
        ds = grain.MapDataset.source(rows).map(self._decode).batch(local, drop_remainder=True)
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=2 * local))
        if self.workers > 0:
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        self.iterator = iter(it)


def device_batch(host_batch, sharding):
    """Place this host's part of the global batch on the mesh (``jax.make_array_from_process_local_data``)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host_batch)
