"""A trained run's backbone for inference: restored from its workdir, run over every local device.

``restore_backbone(workdir)`` rebuilds the backbone in eval mode (running BatchNorm statistics, no dropout) with
the weights of a checkpoint; only parameters and statistics are read, never the FC. ``Embedder`` embeds batches of
uint8 images over every local device. ``deployed(model)`` is the calling convention of exported models
(arcface_torch's): float32 ``[B, 3, S, S]`` NCHW RGB normalised as ``(x/255 − 0.5)/0.5`` → embeddings ``[B, D]``.
``image_source`` lists a folder, a ``.rec`` or a list of images as loaders, and ``embed_images`` embeds them in
batches, reporting and leaving out the images that cannot be read.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from jaxcls.checkpoint import RunCheckpoints, run_config
from jaxcls.data.images import IMAGE_SUFFIXES, image_files
from jaxcls.data.pipeline import normalize, to_image
from jaxcls.data.recordio import MXFaceDataset
from jaxcls.errors import DataError
from jaxcls.eval.verification import embed_in_batches
from jaxcls.extras import optional_import
from jaxcls.mesh import batch_sharding, make_mesh, replicated
from jaxcls.models import make_model, split_model
from jaxcls.registry import lowered_for
from jaxcls.reporting import log


def restore_backbone(workdir: str | os.PathLike, step: int | None = None, *, dtype=jnp.float32,
                     sharding: jax.sharding.Sharding | None = None):
    """``(model, config, step)``: the run's backbone in eval mode computing in ``dtype`` (float32 by default, whatever
    precision it trained in), its weights from checkpoint ``step`` (default: the latest) placed by ``sharding``
    (default: the first local device)."""
    workdir = Path(workdir)
    config = run_config(workdir)
    abstract = nnx.eval_shape(lambda: make_model(config, dtype))
    abstract.eval()
    graphdef, params, stats = split_model(abstract)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    placed = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    checkpoints = RunCheckpoints(workdir / "checkpoints", keep=config.keep_checkpoints)
    try:
        step = checkpoints.latest_step() if step is None else step
        restored, _ = checkpoints.restore({"params": placed(params), "stats": placed(stats)}, step,
                                          parts=("params", "stats"))
    finally:
        checkpoints.close()
    return nnx.merge(graphdef, restored["params"], restored["stats"]), config, step


def agreement(got, want) -> tuple[float, float]:
    """How close embeddings ``got`` are to ``want`` (``[N, D]`` each), row by row in float64: (the lowest cosine, the
    largest max |got − want| / max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    cosine = np.sum(got * want, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return float(cosine.min()), float(np.max(np.abs(got - want).max(1) / np.abs(want).max(1)))


def deployed(model: nnx.Module):
    """``f(float32 [B, 3, S, S] NCHW, normalised) -> float32 [B, D]`` un-normalised embeddings."""

    def embed(images):
        return model(jnp.transpose(images, (0, 2, 3, 1))).astype(jnp.float32)

    return embed


def deployed_input(images: np.ndarray) -> np.ndarray:
    """uint8 ``[B, S, S, 3]`` RGB → what ``deployed`` models take: float32 ``[B, 3, S, S]``, ``(x/255 − 0.5)/0.5``."""
    return np.ascontiguousarray(np.transpose((images.astype(np.float32) / 255 - 0.5) / 0.5, (0, 3, 1, 2)))


class Embedder:
    """``embedder(uint8 [B, S, S, 3] RGB) -> float32 numpy [B, D]``: a restored run's backbone with each batch split
    over the local devices (padded to a multiple of them). ``input_size`` is ``S``."""

    def __init__(self, workdir: str | os.PathLike, step: int | None = None, devices=None):
        devices = jax.local_devices() if devices is None else devices
        mesh = make_mesh(1, len(devices), devices=devices)
        model, config, self.step = restore_backbone(workdir, step, sharding=replicated(mesh))
        self.input_size, self.devices = config.data.input_size, len(devices)
        graphdef, params, stats = split_model(model)
        self.weights, self.sharding = (params, stats), batch_sharding(mesh)

        def embed(weights, images):
            with lowered_for(mesh):
                return nnx.merge(graphdef, *weights)(normalize(images))

        self._embed = jax.jit(embed)

    def __call__(self, images: np.ndarray) -> np.ndarray:
        n = len(images)
        padded = np.concatenate([images, np.zeros((-n % self.devices, *images.shape[1:]), images.dtype)])
        return np.asarray(self._embed(self.weights, jax.device_put(padded, self.sharding)))[:n]


class OnnxEmbedder:
    """The same interface over an exported ``.onnx`` file in onnxruntime (its CPU or CUDA provider)."""

    def __init__(self, path: str | os.PathLike):
        ort = optional_import("onnxruntime", "export")
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        self.session = ort.InferenceSession(str(path), providers=providers)
        spec = self.session.get_inputs()[0]
        if len(spec.shape) != 4 or spec.shape[1] != 3 or not isinstance(spec.shape[2], int):
            raise ValueError(f"{path}: input {spec.name} has shape {spec.shape}, expected [B, 3, S, S]")
        self.input_name, self.input_size, self.step = spec.name, spec.shape[2], None

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: deployed_input(images)})[0]


def open_embedder(workdir: str | os.PathLike | None = None, onnx: str | os.PathLike | None = None,
                  step: int | None = None):
    """An ``Embedder`` of run ``workdir`` or an ``OnnxEmbedder`` of file ``onnx`` (exactly one of the two)."""
    check_model_choice(workdir, onnx, step)
    return Embedder(workdir, step) if onnx is None else OnnxEmbedder(onnx)


def check_model_choice(workdir, onnx, step) -> None:
    """``open_embedder``'s arguments name one model: a CLI checks them before it reads its images."""
    if (workdir is None) == (onnx is None):
        raise ValueError("give exactly one of a run's workdir or an .onnx file")
    if onnx is not None and step is not None:
        raise ValueError("a checkpoint step goes with a workdir; an .onnx file holds one model")


def image_source(spec: str | os.PathLike, size: int) -> tuple[list[str], list[Callable[[], np.ndarray]]]:
    """``(names, loaders)`` of the images of a folder (recursively, by suffix), a ``.rec`` file (with its ``.idx``)
    or a text file listing one image path per line (relative to the list's folder); ``loaders[i]()`` returns
    uint8 ``[size, size, 3]`` RGB or raises ``DataError``/``OSError`` naming the image."""
    path = Path(spec)
    if path.is_dir():
        files = image_files(path)[0]
        names = [p.relative_to(path).as_posix() for p in files]
    elif path.suffix == ".rec":
        data = MXFaceDataset(path.parent, path.stem)
        names = [str(k) for k in data.keys]
        loaders = [lambda i=i: to_image(data.raw(i)[0], size, data.where(i)) for i in range(len(data))]
        return names, loaders
    elif path.is_file():
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        files = [path.parent / name for name in names]
    else:
        raise FileNotFoundError(f"{path}: no such folder, .rec file or image list")
    if not names:
        raise DataError(f"{path}: no images in it (looked for {', '.join(IMAGE_SUFFIXES)})")
    return names, [lambda p=p: to_image(p.read_bytes(), size, str(p)) for p in files]


def embed_images(embed: Callable[[np.ndarray], np.ndarray], loaders: Sequence[Callable[[], np.ndarray]],
                 names: Sequence[str], *, batch_size: int = 256, flip: bool = False, strict: bool = False,
                 threads: int = 8, progress: bool = True):
    """``(embeddings float32 [M, D], kept indices [M], failures [(name, message)])``: every image that loads,
    embedded in batches of ``batch_size`` (the last one padded, so one program serves all); images load in
    ``threads`` threads, one batch ahead of the model. ``flip`` adds the mirror image's embedding. ``strict``:
    the first failure raises."""
    failures, kept, out = [], [], []

    def load(i):
        try:
            return loaders[i]()
        except (DataError, OSError) as e:
            if strict:
                raise
            return e

    starts = range(0, len(loaders), batch_size)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
            tqdm.tqdm(total=len(loaders), unit="img", disable=not progress, dynamic_ncols=True) as bar:
        submit = lambda start: [pool.submit(load, i) for i in range(start, min(start + batch_size, len(loaders)))]
        pending = submit(0) if loaders else []
        for start in starts:
            images = [f.result() for f in pending]
            pending = submit(start + batch_size) if start + batch_size < len(loaders) else []
            for i, image in enumerate(images):
                if isinstance(image, Exception):
                    message = str(image) if isinstance(image, DataError) else f"{names[start + i]}: {image}"
                    log.warning("skipped %s", message)
                    failures.append((names[start + i], message))
            good = [i for i, image in enumerate(images) if isinstance(image, np.ndarray)]
            if good:
                batch = np.stack([images[i] for i in good])
                out.append(embed_in_batches(embed, batch, batch_size, flip).astype(np.float32))
                kept.extend(start + i for i in good)
            bar.update(len(images))
    embeddings = np.concatenate(out) if out else np.zeros((0, 0), np.float32)
    return embeddings, np.asarray(kept, np.int64), failures
