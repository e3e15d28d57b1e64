"""The training input pipeline on Grain: one global stream, each host decoding its rows of every global batch.

The image indices are shuffled anew each epoch with the seed into one global stream, cut into global
batches; a host reads, decodes, augments, flips and stacks only its rows of each (the rows its devices hold in the
batch sharding), a whole host batch per Grain element, batches decoded in parallel threads (JPEGs decode with
libjpeg-turbo, which releases the GIL) or worker processes, with prefetch. Batches are uint8 images
``[B_host, S, S, 3]`` and int32 labels; normalization ``(x/255 − 0.5)/0.5`` happens on the device inside the train
step (``normalize``), so a quarter of the bytes cross to the device. The position saved with every checkpoint counts
global batches, so a resumed run continues with exactly the next batch on any number of hosts.

A record that cannot be read or decoded, or whose label is outside the FC's classes, raises ``DataError`` naming
it (policy ``"error"``), or (``"skip"``) is replaced by the next good record of the source (index + 1, + 2, …: the
same on any host count and after a resume), listed in a log file and counted in ``HostBatches.bad_records``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from PIL import Image

from jaxcls.data.augment import Augment, flip_coins
from jaxcls.data.images import decode_image
from jaxcls.errors import DataError

BAD_RECORDS = ("error", "skip")
MAX_BAD_IN_A_ROW = 100  # with "skip": this many bad records in a row mean the data set is broken


def to_image(data, size: int, where="image") -> np.ndarray:
    """Encoded bytes or an array → uint8 ``[size, size, 3]`` RGB: ``_decoded``, then ``resize_batch`` when needed.
    ``where`` names the image in errors (text, or a function giving it)."""
    image = _decoded(data, size, where)
    return image if image.shape[:2] == (size, size) else resize_batch(image[None], size)[0]


def _decoded(data, size: int, where="image") -> np.ndarray:
    """Encoded bytes → uint8 ``[H, W, 3]`` RGB, a JPEG at least twice ``size`` a side decoded at a reduced scale
    (``decode_image``'s ``at_least``); an array as it is."""
    if isinstance(data, (bytes, bytearray)):
        return decode_image(data, where, at_least=size)
    return np.asarray(data, np.uint8)


def _pillow(image: np.ndarray) -> Image.Image:
    return Image.frombuffer("RGB", image.shape[1::-1], np.ascontiguousarray(image), "raw", "RGB", 0, 1)


def resize_batch(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[N, H, W, 3]`` → ``[N, size, size, 3]``: Pillow's bilinear filter along the rows, then along the
    columns, through uint8 (for square images exactly ``Image.resize``). The row pass runs on the images stacked top
    to bottom, the column pass on them side by side, so each is one long Pillow call without the GIL."""
    n, h, w, _ = images.shape
    if w != size:
        images = np.asarray(_pillow(images.reshape(n * h, w, 3)).resize((size, n * h), Image.BILINEAR))
        images = images.reshape(n, h, size, 3)
    if h != size:
        side_by_side = images.transpose(1, 0, 2, 3).reshape(h, n * size, 3)
        images = np.asarray(_pillow(side_by_side).resize((n * size, size), Image.BILINEAR))
        images = images.reshape(size, n, size, 3).transpose(1, 0, 2, 3)
    return np.ascontiguousarray(images)


def _resize_into(images: np.ndarray, pending: dict[int, np.ndarray]) -> None:
    """``images[row] = `` each ``pending[row]`` (uint8 ``[H, W, 3]``) resized, those of one shape together."""
    for shape in {image.shape for image in pending.values()}:
        rows = [row for row, image in pending.items() if image.shape == shape]
        images[rows] = resize_batch(np.stack([pending[row] for row in rows]), images.shape[1])


def normalize(images: jax.Array) -> jax.Array:
    """uint8 → float32 in [-1, 1]: ``x·(2/255) − 1``, arcface_torch's ``(x/255 − 0.5)/0.5`` in one multiply-add (the
    two differ by at most one float32 step, 1.2e-7)."""
    return images.astype(jnp.float32) * (2.0 / 255.0) - 1.0


class _HostRows:
    """Grain source of this host's part of every global batch: element ``k`` is ``(global positions int64 [R], image
    indices int64 [R])`` of global batch ``first + k``, rows ``start … stop − 1`` (``R = stop − start``).

    Global position ``g`` is the ``g``-th image of the one global stream (the image indices shuffled anew each
    epoch with the seed); global batch ``b`` holds positions ``b·G … b·G + G − 1``. Nothing here depends on the
    number of hosts, so the batches are the same on 1 process or many.
    """

    def __init__(self, order, global_batch: int, rows: tuple[int, int], first: int):
        self.order, self.global_batch, self.rows, self.first = order, global_batch, rows, first

    def __len__(self):
        # endless in practice: the order repeats to 2**63 − 1 images
        return len(self.order) // self.global_batch - self.first

    def __getitem__(self, k):
        start = (self.first + k) * self.global_batch
        positions = np.arange(start + self.rows[0], start + self.rows[1], dtype=np.int64)
        return positions, np.array([self.order[p] for p in positions.tolist()], np.int64)


class _DecodeBatch:
    """Grain map: ``(positions [R], indices [R]) -> (uint8 images [R, S, S, 3], int32 labels [R], int32 records
    skipped)``: read, check the label and decode each image into one array, those of another size resized together
    (``resize_batch``), augment them (``Augment.apply``), then mirror those whose coin (``flip_coins``) says so. With
    ``skip``, a bad record is replaced by the next good one in the source and its error appended to ``log``."""

    def __init__(self, source, size: int, flip: bool, augment: Augment, seed: int, num_classes: int | None,
                 skip: bool, log: str | None):
        self.source, self.size, self.flip, self.augment, self.seed = source, size, flip, augment, seed
        self.num_classes, self.skip, self.log = num_classes, skip, log

    def _load(self, index: int) -> tuple[np.ndarray, int]:
        data, label = self.source.raw(index)
        if self.num_classes is not None and not 0 <= label < self.num_classes:
            raise DataError(f"label {label} of {self.source.where(index)} is outside [0, {self.num_classes})")
        return _decoded(data, self.size, functools.partial(self.source.where, index)), label

    def _good(self, index: int) -> tuple[np.ndarray, int, int]:
        """The image and label of the first good record from ``index`` on, and how many bad ones were passed."""
        for skipped in range(MAX_BAD_IN_A_ROW):
            try:
                return *self._load((index + skipped) % len(self.source)), skipped
            except DataError as e:
                if not self.skip:
                    raise
                if self.log:
                    with open(self.log, "a") as f:
                        f.write(str(e).replace("\n", " ") + "\n")
        raise DataError(f"{MAX_BAD_IN_A_ROW} bad records in a row from {self.source.where(index)} on: "
                        "the data set is broken")

    def __call__(self, element):
        positions, indices = element
        images = np.empty((len(indices), self.size, self.size, 3), np.uint8)
        labels, pending, skipped = np.empty(len(indices), np.int32), {}, 0
        for row, index in enumerate(indices.tolist()):
            image, labels[row], bad = self._good(index)
            if image.shape[:2] == (self.size, self.size):
                images[row] = image
            else:
                pending[row] = image
            skipped += bad
        _resize_into(images, pending)
        self.augment.apply(images, self.seed, positions)
        if self.flip:  # whole 3-byte pixels: twice as fast as numpy's byte-wise images[:, :, ::-1]
            pixels, mirrored = images.view("V3"), flip_coins(self.seed, positions)
            pixels[mirrored] = pixels[mirrored, :, ::-1]
        return images, labels, np.int32(skipped)


class HostBatches:
    """An endless iterator of this host's ``(uint8 images [rows, S, S, 3], int32 labels [rows])`` training batches.

    Its state is the number of *global* batches consumed: the same on every host and for any host count,
    so a run checkpointed on 2 processes resumes on 1 (or 8) with exactly the next global batch.
    ``threads`` host batches are decoded at once, in threads of this process, or (``workers > 0``) of each of that
    many worker processes. ``augment`` (none by default) changes each image before the flip. Labels are checked
    against ``num_classes`` when given. ``bad_records``: ``"error"`` raises the ``DataError`` of a bad record from
    ``next``; ``"skip"`` replaces it (see the module) and appends its error to the file ``bad_records_log`` when
    decoded (which runs ahead of ``next``: a record may be listed before its batch is taken, or twice across a
    resume); ``self.bad_records`` counts the records skipped in the batches this iterator returned since it was made
    or ``set_state``.
    """

    def __init__(self, source, *, global_batch: int, rows: tuple[int, int], size: int, seed: int, flip: bool = True,
                 augment: Augment = Augment(), workers: int = 0, threads: int = 2, num_classes: int | None = None,
                 bad_records: str = "error", bad_records_log: str | None = None):
        if not 0 <= rows[0] < rows[1] <= global_batch:
            raise ValueError(f"host rows {rows} are not a part of a global batch of {global_batch}")
        if bad_records not in BAD_RECORDS:
            raise ValueError(f"unknown bad_records policy {bad_records!r}: choose error or skip")
        self.source, self.global_batch, self.rows = source, global_batch, rows
        self.size, self.seed, self.flip, self.workers, self.threads = size, seed, flip, workers, threads
        self._decode = _DecodeBatch(source, size, flip, augment, seed, num_classes, bad_records == "skip",
                                    None if bad_records_log is None else str(bad_records_log))
        self.set_state({"global_batches": 0})

    def __iter__(self):
        return self

    def __next__(self):
        images, labels, skipped = next(self.iterator)
        self.consumed += 1
        self.bad_records += int(skipped)
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
        ds = grain.MapDataset.source(rows).map(self._decode)
        # elements are whole host batches: one per thread in flight, and one ready
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.threads + 1))
        if self.workers > 0:
            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags, parsed by the CLIs, not from Python
                flags.FLAGS.mark_as_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        self.iterator = iter(it)


def device_batch(host_batch, sharding):
    """Place this host's part of the global batch on the mesh (``jax.make_array_from_process_local_data``)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host_batch)
