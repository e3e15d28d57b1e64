"""PartialFC's draw of the sampled classes on one device: the sort jaxcls runs (``lax.top_k`` of a key per class, then
``jnp.sort`` of the rows drawn) against a candidate that draws the same rows without sorting (``top_rows``).

    python benchmarks/partialfc_draw.py                         # 1M, 8M and 36,925,351 classes, the default device
    python benchmarks/partialfc_draw.py --classes 4000000 --sample-rate 0.2
    python benchmarks/partialfc_draw.py --small                 # 100k classes: what the tests run
    JAX_PLATFORMS=cpu python benchmarks/partialfc_draw.py --target h100 --classes 4000000 36925351  # compile-only

Both forms take the same keys (``draw_keys``, with a batch of 128 labels as positives) and must draw the same rows
(checked at each class count; ``tests/test_benchmarks.py`` checks ``top_rows`` against ``lax.top_k`` on keys with
many ties); each is timed by the median of 20 synchronized calls after 3 (``jaxcls.bench.time_ms``), and its
compiled temporaries per class are reported. On a CUDA GPU XLA runs the sorts with CUB's radix sort; compiled for a
GPU without one (``jaxcls.plan.gpu_target``) and on CPUs they are XLA's own sorts. ``--target`` compiles both forms
for that GPU instead of timing them: the kernels in their PTX (a bitonic sort's passes each one), the bytes those
kernels read and write (``jaxcls.plan.kernels``, which counts a sort as one pass) and the temporaries.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcls.bench import print_table, time_ms, write_json
from jaxcls.fc.sampling import sample_budget
from jaxcls.plan import gpu_target
from jaxcls.plan.kernels import kernels

DRAW_BITS = 23  # the random bits of a class's key: those of a float32 jax.random.uniform draw
KEY_DIGIT = 4  # top_rows finds the threshold key this many bits at a time


def draw_keys(key, labels, classes: int) -> jax.Array:
    """A key ``[classes]`` int32 per class: ``1 +`` 23 random bits, ``2^23 + 1`` for the classes of ``labels``. The
    random keys order the classes, ties included, as jaxcls' ``jax.random.uniform`` scores do (``1.bits[9:] − 1``)."""
    bits = jax.random.bits(key, (classes,), jnp.uint32)
    keys = lax.shift_right_logical(bits, jnp.uint32(32 - DRAW_BITS)).astype(jnp.int32) + 1
    return keys.at[labels].set(2**DRAW_BITS + 1)


def by_sorting(keys, count: int):
    """The rows of the ``count`` largest keys, ascending, as ``jaxcls.fc.sampling`` draws them."""
    return jnp.sort(lax.top_k(keys, count)[1])


def top_rows(keys: jax.Array, count: int) -> jax.Array:
    """``by_sorting`` (ties lowest index first) for keys in ``[0, 2^24)``, without a sort: the ``count``-th largest key
    found ``KEY_DIGIT`` bits at a time, each digit by counting the keys at or above each of its values (6 reads of
    the keys), then a prefix sum that ranks the ties at it and one that places the rows in order."""
    threshold = jnp.int32(0)  # invariant: at least `count` keys are at or above it
    for shift in range(24 - KEY_DIGIT, -1, -KEY_DIGIT):
        steps = jnp.arange(1, 2**KEY_DIGIT, dtype=jnp.int32) << shift
        at_or_above = jnp.sum(keys[:, None] >= threshold + steps, axis=0, dtype=jnp.int32)  # falls with the step
        threshold = threshold + (jnp.sum(at_or_above >= count, dtype=jnp.int32) << shift)
    above, tie = keys > threshold, keys == threshold
    quota = count - jnp.sum(above, dtype=jnp.int32)  # of the ties, the first this many
    taken = above | (tie & (jnp.cumsum(tie, dtype=jnp.int32) <= quota))
    index = jnp.arange(keys.shape[0], dtype=jnp.int32)
    place = jnp.where(taken, jnp.cumsum(taken, dtype=jnp.int32) - 1, count + index)  # the rest: dropped, distinct
    return jnp.zeros(count, jnp.int32).at[place].set(index, mode="drop", unique_indices=True)


FORMS = (("lax.top_k + jnp.sort (jaxcls)", by_sorting), ("top_rows (no sort)", top_rows))


def rows(classes: int, rate: float, batch: int) -> list[dict]:
    count = sample_budget(classes, batch, rate)
    labels = jax.random.randint(jax.random.key(1), (batch,), 0, classes)
    keys = jax.jit(draw_keys, static_argnums=2)(jax.random.key(0), labels, classes)
    forms = {name: jax.jit(form, static_argnums=1).lower(keys, count).compile() for name, form in FORMS}
    drawn = [np.asarray(f(keys)) for f in forms.values()]
    if not np.array_equal(*drawn):
        raise SystemExit(f"the two forms drew different rows at {classes} classes")
    return [{"classes": classes, "rows": count, "form": name, "ms": time_ms(f, keys),
             "temp_bytes_per_class": f.memory_analysis().temp_size_in_bytes / classes} for name, f in forms.items()]


def compiled_rows(classes: int, rate: float, batch: int, target: str) -> list[dict]:
    """Both forms compiled for one ``target`` GPU (no GPU needed): their kernels, bytes and temporaries."""
    device = gpu_target.gpu_devices(target, 1)[0]
    keys = jax.ShapeDtypeStruct((classes,), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    count = sample_budget(classes, batch, rate)
    table = []
    for name, form in FORMS:
        with tempfile.TemporaryDirectory() as dump:
            compiled = jax.jit(form, static_argnums=1).lower(keys, count).compile(
                {**gpu_target.COMPILE_OPTIONS, "xla_dump_to": dump})
            entries = [e for ptx in Path(dump).glob("*.ptx") for e in re.findall(r"\.entry\s+(\w+)", ptx.read_text())]
        table.append({"classes": classes, "rows": count, "form": name, "target": target, "ptx_kernels": len(entries),
                      "moved_GiB": sum(k.moved_bytes * k.count for k in kernels(compiled.as_text())) / 2**30,
                      "temp_bytes_per_class": compiled.memory_analysis().temp_size_in_bytes / classes})
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+")
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--target", choices=list(gpu_target.TARGETS), help="compile for this GPU instead of timing")
    parser.add_argument("--out", default="benchmarks/results/partialfc_draw.json")
    args = parser.parse_args()
    classes = args.classes or ([100_000] if args.small else [1_000_000, 8_000_000, 36_925_351])
    if args.target:
        table = [r for c in classes for r in compiled_rows(c, args.sample_rate, args.batch, args.target)]
        print_table(table, ["classes", "rows", "form", "ptx_kernels", "moved_GiB", "temp_bytes_per_class"])
    else:
        table = [r for c in classes for r in rows(c, args.sample_rate, args.batch)]
        print_table(table, ["classes", "rows", "form", "ms", "temp_bytes_per_class"])
    write_json(args.out, table)


if __name__ == "__main__":
    main()
