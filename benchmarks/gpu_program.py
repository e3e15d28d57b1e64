"""What XLA:GPU makes of the train step, kernel by kind, beside a minimal plain-Flax step — no GPU needed.

Both programs are compiled for one H100 (``jaxcls.plan.gpu_target``) and read back from their HLO
(``jaxcls.plan.kernels``): kernels by kind (fusions, cuDNN convolutions with their dtype and layout, GEMMs,
collectives, sorts, copies/transposes) with their count and result bytes per step, then the largest float32
results (float32 work on a bfloat16 step's hot path). The reference is a plain Flax step (``jaxcls.bench.plain_step``,
measured on an H100 in docs/benchmarks.md): a linen IResNet-50 in bfloat16
with float32 parameters, a dense normalised FC of 100k rows with a CosFace margin and softmax cross-entropy, SGD with
momentum, one ``jax.jit`` with donation.

    python benchmarks/gpu_program.py                     # r50, batch 128, 1M classes, PartialFC 0.1, bf16 FC
    python benchmarks/gpu_program.py --set sample_rate=1.0 --set num_classes=100000
    python benchmarks/gpu_program.py --small             # narrow models at 32 px: what the tests run

It counts, it does not time: a kernel's cost is not its result size. Needs JAX's CUDA plugin.
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: no CUDA driver is needed, none is started

from jaxcls.bench import CONFIG_KEY, plain_model, plain_program, print_table, write_json  # noqa: E402
from jaxcls.config import benchmark_config  # noqa: E402
from jaxcls.plan import gpu_target  # noqa: E402
from jaxcls.plan.kernels import KERNEL_KINDS, kernels, moved_by_origin  # noqa: E402
from jaxcls.run import build  # noqa: E402


def jaxcls_program(overrides: list[str], small: bool, device):
    """jaxcls's step compiled for ``device`` (the face recipe with CosFace and a bfloat16 FC), and its config."""
    c = benchmark_config(small=small, overrides=overrides, num_classes=8192 if small else 1_000_000,
                         fc_dtype="bfloat16", precision="bfloat16",  # bfloat16 when --small too
                         margin=dict(name="cosface", s=64.0, m=0.4, straight_through=False))
    run = build(c, [device], with_data=False)
    return c, run.compile_step(run.abstract_state, gpu_target.COMPILE_OPTIONS)


def summary(compiled) -> tuple[list[dict], list]:
    """Per kind: kernels per step, their result MiB and the GiB they read and write; every float32 kernel result
    of 1 MiB or more; and the JAX source lines whose kernels move the most bytes."""
    found = kernels(compiled.as_text())
    counts, sizes, moved = (collections.Counter() for _ in range(3))
    for k in found:
        counts[k.kind] += k.count
        sizes[k.kind] += k.result_bytes * k.count
        moved[k.kind] += k.moved_bytes * k.count
    conv = collections.Counter(f"{k.dtype} {k.detail}" for k in found if k.kind == "cuDNN convolution")
    rows = [{"kind": kind, "kernels": counts[kind], "result_MiB": sizes[kind] / 2**20,
             "moved_GiB": moved[kind] / 2**30} for kind in KERNEL_KINDS]
    float32 = sorted(((k.name, k.result_bytes * k.count / 2**20) for k in found
                      if k.dtype == "f32" and k.result_bytes >= 2**20), key=lambda x: -x[1])
    return rows, [conv, float32, moved_by_origin(found).most_common(12)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--set", action="append", default=[], help=CONFIG_KEY)
    parser.add_argument("--out", default="benchmarks/results/gpu_program.json")
    args = parser.parse_args()
    device = gpu_target.gpu_devices(args.target, 1)[0]
    config, ours = jaxcls_program(args.set, args.small, device)
    model = plain_model(args.small)
    plain = plain_program(config.batch_size, config.data.input_size, 4096 if args.small else 100_000, model, device)
    rows = []
    for name, compiled in (("jaxcls", ours), ("plain Flax", plain)):
        table, (conv, float32, lines) = summary(compiled)
        memory = compiled.memory_analysis()
        rows += [dict(r, program=name) for r in table]
        print(f"\n{name}: {memory.temp_size_in_bytes / 2**30:.2f} GiB temporaries; convolutions: {dict(conv)}")
        print("float32 results of 1 MiB or more (name, MiB per step): "
              + (", ".join(f"{n} {m:.0f}" for n, m in float32[:12]) or "none"))
        print("source lines whose kernels read and write the most (GiB per step): "
              + ", ".join(f"{line} {b / 2**30:.2f}" for line, b in lines))
    print()
    print_table(rows, ["program", "kind", "kernels", "result_MiB", "moved_GiB"])
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
