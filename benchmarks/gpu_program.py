"""What XLA:GPU makes of the train step, kernel by kind, beside a minimal plain-Flax step — no GPU needed.

Both programs are compiled for one H100 (``jaxcls.gpu_target``) and read back from their HLO (``jaxcls.hlo.kernels``):
kernels by kind (fusions, cuDNN convolutions with their dtype and layout, GEMMs, collectives, sorts,
copies/transposes) with their count and result bytes per step, then the largest float32 results (float32 work on
a bfloat16 step's hot path). The reference is the program ANCHORS measured at 5,496 img/s (batch 128) on an H100
against arcface_torch's 1,505: a linen IResNet-50 in bfloat16 with float32 parameters, a dense normalised FC of
100k rows with a CosFace margin and softmax cross-entropy, SGD with momentum, one ``jax.jit`` with donation.

    python benchmarks/gpu_program.py                     # r50, batch 128, 1M classes, PartialFC 0.1, bf16 FC
    python benchmarks/gpu_program.py --set sample_rate=1.0 --set num_classes=100000
    python benchmarks/gpu_program.py --small             # narrow models at 32 px: what the tests run

It counts, it does not time: a kernel's cost is not its result size. Needs JAX's CUDA plugin.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no CUDA driver is needed, none is started

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from common import print_table, write_json  # noqa: E402

from jaxcls import gpu_target  # noqa: E402
from jaxcls.hlo import KERNEL_KINDS, kernels  # noqa: E402


class Block(nn.Module):
    """insightface's IBasicBlock: BN, conv3×3, BN, PReLU, conv3×3 (stride), BN, plus the (projected) input."""

    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        bn = lambda y: nn.BatchNorm(use_running_average=False, epsilon=1e-5, dtype=jnp.bfloat16)(y)
        conv = lambda y, s: nn.Conv(self.width, (3, 3), s, padding=1, use_bias=False, dtype=jnp.bfloat16)(y)
        y = bn(conv(nn.PReLU(param_dtype=jnp.float32)(bn(conv(bn(x), 1))), self.stride))
        if self.stride != 1 or x.shape[-1] != self.width:
            x = bn(nn.Conv(self.width, (1, 1), self.stride, use_bias=False, dtype=jnp.bfloat16)(x))
        return x + y


class PlainIResNet(nn.Module):
    stages: tuple = (3, 4, 14, 3)
    base: int = 64
    features: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.base, (3, 3), padding=1, use_bias=False, dtype=jnp.bfloat16)(x.astype(jnp.bfloat16))
        x = nn.PReLU(param_dtype=jnp.float32)(nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)(x))
        for stage, blocks in enumerate(self.stages):
            for i in range(blocks):
                x = Block(self.base * 2**stage, 2 if i == 0 else 1)(x)
        x = nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)(x).reshape(x.shape[0], -1)
        x = nn.Dense(self.features, dtype=jnp.bfloat16)(x)
        return nn.BatchNorm(use_running_average=False, use_scale=False)(x.astype(jnp.float32))


def plain_program(batch: int, size: int, rows: int, model: PlainIResNet, device):
    """The reference step for ``device``: ``(params, stats, fc, momenta), images, labels → same, loss``."""
    images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(images.shape, images.dtype)))
    fc = jax.ShapeDtypeStruct((rows, model.features), jnp.float32)
    optimizer = optax.sgd(0.1, momentum=0.9)
    trainable = {"params": variables["params"], "fc": fc}
    state = (trainable, variables["batch_stats"], jax.eval_shape(optimizer.init, trainable))

    def step(state, images, labels):
        trainable, stats, opt = state

        def loss_fn(trainable):
            embeddings, new = model.apply({"params": trainable["params"], "batch_stats": stats}, images,
                                          mutable=["batch_stats"])
            e = embeddings / jnp.linalg.norm(embeddings, axis=1, keepdims=True)
            w = trainable["fc"] / jnp.linalg.norm(trainable["fc"], axis=1, keepdims=True)
            logits = (e.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16).T).astype(jnp.float32)
            logits = 64.0 * (logits - 0.4 * jax.nn.one_hot(labels, rows))
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt = optimizer.update(grads, opt, trainable)
        return (optax.apply_updates(trainable, updates), stats, opt), loss

    placed = jax.sharding.SingleDeviceSharding(device)
    put = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)
    return jax.jit(step, donate_argnums=0).lower(put(state), put(images), put(labels)).compile()


def jaxcls_program(overrides: dict, small: bool, device):
    from jaxcls.config import face_config
    from jaxcls.run import build

    c = face_config(root="/not/read", num_classes=1_000_000, num_images=10**7, epochs=1, batch=128, sample_rate=0.1)
    c.data.kind, c.fc_dtype, c.margin = "synthetic", "bfloat16", dict(name="cosface", s=64.0, m=0.4,
                                                                       straight_through=False)
    if small:
        c.data.input_size, c.model, c.model_kwargs, c.num_features, c.num_classes = 32, "r18", {"width": 8}, 32, 8192
    c.update(overrides)
    run = build(c, [device], with_data=False)
    return c, run.compile_step(run.abstract_state, gpu_target.COMPILE_OPTIONS)


def summary(compiled) -> tuple[list[dict], list]:
    """Per kind: kernels per step and their result MiB; and every float32 kernel result of 1 MiB or more."""
    found = kernels(compiled.as_text())
    counts, sizes = collections.Counter(), collections.Counter()
    for k in found:
        counts[k.kind] += k.count
        sizes[k.kind] += k.result_bytes * k.count
    conv = collections.Counter(f"{k.dtype} {k.detail}" for k in found if k.kind == "cuDNN convolution")
    rows = [{"kind": kind, "kernels": counts[kind], "result_MiB": sizes[kind] / 2**20} for kind in KERNEL_KINDS]
    float32 = sorted(((k.name, k.result_bytes * k.count / 2**20) for k in found
                      if k.dtype == "f32" and k.result_bytes >= 2**20), key=lambda x: -x[1])
    return rows, [conv, float32]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE: a jaxcls config key")
    parser.add_argument("--out", default="benchmarks/results/gpu_program.json")
    args = parser.parse_args()
    device = gpu_target.gpu_devices(args.target, 1)[0]
    overrides = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.set)}
    config, ours = jaxcls_program(overrides, args.small, device)
    model = PlainIResNet((2, 2, 2, 2), 8, 32) if args.small else PlainIResNet()
    plain = plain_program(config.batch_size, config.data.input_size, 4096 if args.small else 100_000, model, device)
    rows = []
    for name, compiled in (("jaxcls", ours), ("plain Flax", plain)):
        table, (conv, float32) = summary(compiled)
        memory = compiled.memory_analysis()
        rows += [dict(r, program=name) for r in table]
        print(f"\n{name}: {memory.temp_size_in_bytes / 2**30:.2f} GiB temporaries; convolutions: {dict(conv)}")
        print("float32 results of 1 MiB or more (name, MiB per step): "
              + (", ".join(f"{n} {m:.0f}" for n, m in float32[:12]) or "none"))
    print()
    print_table(rows, ["program", "kind", "kernels", "result_MiB"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
