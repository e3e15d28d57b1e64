"""A trained backbone out of JAX: ONNX (onnxruntime, TensorRT, insightface's model zoo) and serialized StableHLO.

Both files take what arcface_torch's exported models take: float32 ``[B, 3, S, S]`` NCHW RGB images normalised as
``(x/255 − 0.5)/0.5`` outside the model, any batch size ``B``; both return un-normalised float32 embeddings
``[B, D]``. The backbone runs in eval mode and in float32 whatever precision it trained in. ONNX is written by
``jax2onnx`` from the model's jaxpr (every backbone's primitives convert as they are; no plugin was needed);
``.jaxexport`` is ``jax.export``'s serialization for CPU and CUDA, reloaded with ``load_jax_export``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxcls
from jaxcls.extras import optional_import
from jaxcls.interop.inference import deployed, restore_backbone
from jaxcls.models import grouped_conv

ONNX_OPSET = 17  # the lowest that holds every op the backbones need; TensorRT 8.6+ and onnxruntime 1.12+ read it
INPUT = "float32 [B, 3, S, S] NCHW RGB, (x/255 - 0.5)/0.5"


def export_onnx(model, path: str | os.PathLike, input_size: int, metadata: dict | None = None):
    """Write ``model`` (eval mode) as ONNX to ``path``: input ``images`` ``[B, 3, S, S]`` with ``B`` dynamic, output
    ``embeddings`` ``[B, D]``; producer jaxcls, opset ``ONNX_OPSET``, ``metadata`` as metadata properties."""
    jax2onnx = optional_import("jax2onnx", "export")
    onnx = optional_import("onnx", "export")
    # quiet: notes per constant on untyped shape values, and tracebacks of plugins for libraries not installed here
    for logger in ("onnx_ir.serde", "jax2onnx.plugins.plugin_system"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    # ONNX's Conv takes groups, which ONNX runtimes run well: XLA's grouped form, not a platform's (``grouped_conv``)
    with warnings.catch_warnings(), grouped_conv.forced("xla"):  # jax2onnx's Flax plugins read the deprecated `.value`
        warnings.simplefilter("ignore", DeprecationWarning)
        proto = jax2onnx.to_onnx(deployed(model), [("B", 3, input_size, input_size)], model_name="jaxcls",
                                 opset=ONNX_OPSET, input_names=["images"], output_names=["embeddings"])
    proto.producer_name, proto.producer_version = "jaxcls", jaxcls.__version__
    properties = {"input": INPUT, "output": "float32 [B, D] embeddings, not normalised",
                  "converter": f"jax2onnx {_version('jax2onnx')}", **(metadata or {})}
    onnx.helper.set_model_props(proto, {k: str(v) for k, v in properties.items()})
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
    return proto


def export_jax(model, path: str | os.PathLike, input_size: int, platforms=("cpu", "cuda")) -> jax.export.Exported:
    """Write ``model`` (eval mode) as serialized StableHLO to ``path``, weights included, batch size symbolic."""
    batch, = jax.export.symbolic_shape("B")
    images = jax.ShapeDtypeStruct((batch, 3, input_size, input_size), jnp.float32)
    exported = jax.export.export(jax.jit(deployed(model)), platforms=platforms)(images)
    Path(path).write_bytes(exported.serialize())
    return exported


def load_jax_export(path: str | os.PathLike):
    """``f(float32 [B, 3, S, S] normalised) -> [B, D]`` from a ``.jaxexport`` file."""
    return jax.export.deserialize(bytearray(Path(path).read_bytes())).call


def export_run(workdir: str | os.PathLike, step: int | None = None, onnx: str | None = None,
               jax_export: str | None = None) -> int:
    """Export checkpoint ``step`` (default: the latest) of run ``workdir`` to the given files; returns the step."""
    if not onnx and not jax_export:
        raise ValueError("nothing to export: give an .onnx path, a .jaxexport path or both")
    model, config, step = restore_backbone(workdir, step)
    size = config.data.input_size
    if onnx:
        export_onnx(model, onnx, size, {"model": config.model, "embedding_size": config.num_features,
                                        "input_size": size, "workdir": Path(workdir).absolute(), "step": step})
    if jax_export:
        export_jax(model, jax_export, size)
    return step


def _version(package: str) -> str:
    from importlib.metadata import version
    return version(package)
