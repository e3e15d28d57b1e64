"""What a 16-bit FC weight loses at many classes: the same FC-only training with float32 and bfloat16 storage.

    python benchmarks/fc_rounding.py --classes 1000000 --steps 300 --out results/fc_rounding.json
    python benchmarks/fc_rounding.py --small                 # what the tests run

A bfloat16 weight keeps 8 significant bits: an entry near 0.01 moves only if its update exceeds ~3e-5. At millions
of classes a row that is not the batch's label gets a softmax probability near 1/C, so its gradient, and its weight
decay (lr · wd · w ≈ 5e-7), fall far below that step and vanish. This measures how much, and whether it matters:
``--active`` classes have fixed random unit centres and every batch draws its labels among them, embeddings are
their centre plus noise, and all ``--classes`` rows (the rest never a label, as the long tail of a large data set
is rarely seen) are sampled by PartialFC and trained by the trainer's own fused step (``FCHead.step``, SGD with
momentum, CosFace). Both storages start from the same (bfloat16-representable) weight and see the same batches and
samples. Three storages: float32, bfloat16 rounded to nearest, bfloat16 rounded stochastically
(``fc_weight_rounding``). Reported per storage: the training loss at the end, the share of sampled weight entries
that the last step changed (positive rows, i.e. the batch's labels, and the others apart), how far its final weight
is from float32's as a share of how far float32's moved from the start (active rows and the others apart: 0 is
float32's run, 1 as far off as not training those rows at all), and, on fresh embeddings of the active classes
against all ``--classes`` rows, top-1 retrieval and the softmax cross-entropy (scale 32, no margin: how well every
other class is kept away).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxcls import batch_sharding, make_mesh
from jaxcls.bench import print_table, write_json
from jaxcls.fc import FCHead
from jaxcls.fc.optimizers import sgd
from jaxcls.losses import cosface, l2_normalize


def batches(rng, centres, batch, noise):
    """Labels among the active classes and their embeddings (centre + Gaussian noise), forever."""
    while True:
        labels = rng.integers(0, len(centres), batch)
        yield (centres[labels] + noise * rng.normal(size=(batch, centres.shape[1]))).astype(np.float32), labels


STORAGES = [(jnp.float32, "nearest"), (jnp.bfloat16, "nearest"), (jnp.bfloat16, "stochastic")]  # weight, rounding


def train(dtype, rounding, args, init):
    """The row of one storage, and its final weight (float32)."""
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    head = FCHead(mesh, args.classes, args.dim, cosface(s=32.0, m=0.35), sgd(state_dtype=dtype,
                                                                                weight_rounding=rounding),
                  sample_rate=args.sample_rate, chunk_size=65_536, dtype=dtype)
    weight, state = head.init(jax.random.key(0))
    weight = jnp.asarray(init, dtype)
    rng = np.random.default_rng(1)
    centres = np.asarray(l2_normalize(jnp.asarray(rng.normal(size=(args.active, args.dim)), jnp.float32)))
    data = batches(rng, centres, args.batch, args.noise)
    sharding = batch_sharding(mesh)

    @jax.jit
    def step(weight, state, emb, labels, key):
        sample = head.sample(key, labels)
        loss, _, new_weight, new_state = head.step(weight, state, emb, labels, sample, args.lr)
        real = sample.classes < args.classes  # one device: a sampled row's class is its row
        rows = jnp.where(real, sample.classes, 0)
        positive = jnp.isin(rows, labels) & real
        other = ~positive & real
        moved = jnp.mean(new_weight[rows] != weight[rows], axis=1)  # share of the row's entries that changed
        return (loss, new_weight, new_state, jnp.sum(moved * positive) / jnp.sum(positive),
                jnp.sum(moved * other) / jnp.sum(other))

    losses = []
    for i in range(args.steps):
        emb, labels = next(data)
        loss, weight, state, moved_pos, moved_neg = step(
            weight, state, jax.device_put(emb, sharding), jax.device_put(labels.astype(np.int32), sharding),
            jax.random.key(100 + i))
        losses.append(float(loss))
    probe, truth = next(batches(np.random.default_rng(2), centres, 512, args.noise))
    cos = l2_normalize(jnp.asarray(probe)) @ l2_normalize(weight.astype(jnp.float32)).T
    top1 = float(jnp.mean(jnp.argmax(cos, axis=1) == truth))
    probe_loss = float(jnp.mean(jax.nn.logsumexp(32.0 * cos, axis=1) - 32.0 * cos[jnp.arange(len(truth)), truth]))
    return {"fc_dtype": jnp.dtype(dtype).name, "fc_weight_rounding": rounding, "classes": args.classes,
            "active": args.active, "steps": args.steps, "sample_rate": args.sample_rate, "loss_first": losses[0],
            "loss_last": float(np.mean(losses[-10:])), "moved_positive": float(moved_pos),
            "moved_other": float(moved_neg), "top1": top1, "probe_loss": probe_loss}, weight.astype(jnp.float32)


def off_float32(weight, float32, init, rows) -> float:
    """``‖weight − float32‖ / ‖float32 − init‖`` over ``rows``."""
    return float(jnp.linalg.norm(weight[rows] - float32[rows]) / jnp.linalg.norm(float32[rows] - init[rows]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", type=int, default=1_000_000)
    p.add_argument("--active", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sample_rate", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default="benchmarks/results/fc_rounding.json")
    args = p.parse_args()
    if args.small:
        args.classes, args.active, args.dim, args.batch, args.steps = 4096, 64, 16, 32, 3
    init = 0.01 * np.random.default_rng(0).normal(size=(args.classes, args.dim))
    init = np.asarray(jnp.asarray(init, jnp.bfloat16).astype(jnp.float32))  # one start, exact in both storages
    runs = [train(dtype, rounding, args, init) for dtype, rounding in STORAGES]
    init, float32 = jnp.asarray(init), runs[0][1]
    active, other = slice(0, args.active), slice(args.active, args.classes)  # the labels are the first classes
    rows = [dict(row, off_float32_active=off_float32(weight, float32, init, active),
                 off_float32_other=off_float32(weight, float32, init, other)) for row, weight in runs]
    print_table(rows, ["fc_dtype", "fc_weight_rounding", "classes", "active", "steps", "loss_first", "loss_last",
                       "moved_positive", "moved_other", "off_float32_active", "off_float32_other", "top1",
                       "probe_loss"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
