"""The plain Flax step ANCHORS measured on an H100 (5,496 img/s at batch 128, against arcface_torch's 1,505): a linen
IResNet-50 in bfloat16 with float32 parameters, a dense normalised FC with a CosFace margin and softmax cross-entropy,
SGD with momentum, one ``jax.jit`` with donation. jaxcls's step is measured against it (``gpu_program.py`` compiles
both, ``profile_step.py`` runs both)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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


def plain_model(small: bool) -> PlainIResNet:
    """IResNet-50, or for the benchmarks' ``--small`` modes a narrow (2, 2, 2, 2) one with 32-d embeddings."""
    return PlainIResNet((2, 2, 2, 2), 8, 32) if small else PlainIResNet()


def plain_step(model: PlainIResNet, rows: int):
    """The reference step ``(trainable, stats, momenta), images, labels → same, loss`` and its
    ``init(key, images) → state`` (``rows`` FC rows, all in every step)."""
    optimizer = optax.sgd(0.1, momentum=0.9)

    def init(key, images):
        variables = model.init(key, images)
        trainable = {"params": variables["params"],
                     "fc": 0.01 * jax.random.normal(jax.random.fold_in(key, 1), (rows, model.features))}
        return trainable, variables["batch_stats"], optimizer.init(trainable)

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

    return step, init


def plain_program(batch: int, size: int, rows: int, model: PlainIResNet, device):
    """The reference step compiled for ``device`` (jitted with the state donated)."""
    step, init = plain_step(model, rows)
    images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    state = jax.eval_shape(init, jax.random.key(0), images)
    placed = jax.sharding.SingleDeviceSharding(device)
    put = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)
    return jax.jit(step, donate_argnums=0).lower(put(state), put(images), put(labels)).compile()
