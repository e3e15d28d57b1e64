"""PartialFC's draw of the sampled classes on one device: without a sort (``jaxcls.fc.sampling.top_rows``, what
jaxcls runs) against the sort it replaced (``lax.top_k`` of every class's key, then ``jnp.sort`` of the rows).

    python benchmarks/partialfc_draw.py                         # 1M, 8M and 36,925,351 classes, the default device
    python benchmarks/partialfc_draw.py --classes 4000000 --sample-rate 0.2
    python benchmarks/partialfc_draw.py --small                 # 100k classes: what the tests run

Both forms take the same keys (``sampling.draw_keys``: a batch of 128 labels as positives) and draw the same rows,
checked per class count; each is timed by the median of 20 synchronized calls after 3 (``jaxcls.bench.time_ms``).
On a CUDA GPU XLA runs ``lax.top_k``'s sort with CUB's radix sort; compiled for a GPU without one (``jaxcls.plan.
gpu_target``) and on CPUs it is XLA's own sort.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcls.bench import print_table, time_ms, write_json
from jaxcls.fc.sampling import draw_keys, sample_budget, top_rows


def by_sorting(keys, count: int):
    """The rows of the ``count`` largest keys, ascending, as jaxcls drew them before ``top_rows``."""
    return jnp.sort(lax.top_k(keys, count)[1])


def row(classes: int, rate: float, batch: int) -> list[dict]:
    count = sample_budget(classes, batch, rate)
    labels = jax.random.randint(jax.random.key(1), (batch,), 0, classes)
    keys = jax.jit(draw_keys, static_argnums=(2, 3, 4))(jax.random.key(0), labels, 0, classes, classes)
    forms = {"top_rows (no sort)": jax.jit(top_rows, static_argnums=1),
             "lax.top_k + jnp.sort": jax.jit(by_sorting, static_argnums=1)}
    drawn = [np.asarray(f(keys, count)) for f in forms.values()]
    if not np.array_equal(*drawn):
        raise SystemExit(f"the two forms drew different rows at {classes} classes")
    return [{"classes": classes, "rows": count, "form": name, "ms": time_ms(f, keys, count)}
            for name, f in forms.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+")
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/partialfc_draw.json")
    args = parser.parse_args()
    classes = args.classes or ([100_000] if args.small else [1_000_000, 8_000_000, 36_925_351])
    rows = [r for c in classes for r in row(c, args.sample_rate, args.batch)]
    print_table(rows, ["classes", "rows", "form", "ms"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
