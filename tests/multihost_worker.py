"""One process of the multi-process loss check (started by ``tests/test_multihost.py``, not collected by pytest).

On a (data=2, class=4) mesh whose data axis spans the two processes, for both class layouts:
``sharded_margin_loss`` and its gradients, and ``FCHead.step`` with PartialFC, under ``jax.jit`` (called eagerly,
a shard_map runs op by op: 600 small compiles a process). Process 0 writes every result, gathered to the host, to
an ``.npz``; the test compares them with the float64 references. The inputs' host check runs on each process's own
part of the concrete labels: a label out of range in process 1's part stops process 1 alone, naming its global
batch index (checked here: a process whose check goes otherwise exits non-zero).

usage: python tests/multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID SEED OUT.npz
"""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxcls import distributed
from jaxcls.fc import FCHead
from jaxcls.losses import arcface, sharded_margin_loss
from jaxcls.losses.tiles import check_inputs
from jaxcls.mesh import BATCH_ROWS, batch_sharding, class_shards, make_mesh, weight_sharding
from jaxcls.fc.optimizers import SparseState, sgd

LAYOUTS = {"data,class": ("data", "class"), "class": ("class",)}
MESH = (2, 4)


def fc_problem(seed: int, mesh, class_axes):
    """``(head, inputs)``: a PartialFC head and numpy inputs drawn from ``seed`` alone (the same in every process)."""
    rng = np.random.default_rng(seed)
    shards = class_shards(mesh, class_axes)
    c, d, n = shards * int(rng.integers(12, 40)) - int(rng.integers(0, shards)), int(rng.integers(4, 17)), 16
    head = FCHead(mesh, c, d, arcface(), sgd(), sample_rate=0.5, class_axes=class_axes, chunk_size=5)
    real = np.arange(head.rows)[:, None] < c
    inputs = dict(weight=np.where(real, rng.normal(size=(head.rows, d)), 0).astype(np.float32),
                  slot=np.where(real, rng.normal(size=(head.rows, d)) ** 2, 0).astype(np.float32),
                  count=np.int32(rng.integers(0, 50)), emb=rng.normal(size=(n, d)).astype(np.float32),
                  labels=rng.integers(0, c, size=n).astype(np.int32), lr=float(rng.uniform(0.01, 0.5)),
                  key=int(rng.integers(2**31)))
    return head, inputs


def place(array: np.ndarray, sharding) -> jax.Array:
    """A global array from a host array every process holds whole: each process places its shards."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def gathered(array) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def check_inputs_per_process(emb, weight, labels: np.ndarray, mesh, class_axes, num_classes: int) -> None:
    """The host check passes the real labels; with the last label out of range only the process holding it raises,
    naming its global index."""
    placed = place(labels, batch_sharding(mesh))
    check_inputs(emb, weight, placed, mesh, class_axes, num_classes)
    bad, last = labels.copy(), labels.size - 1
    bad[last] = num_classes
    placed = place(bad, batch_sharding(mesh))
    holds_it = any(s.index[0].start <= last < s.index[0].stop for s in placed.addressable_shards)
    try:
        check_inputs(emb, weight, placed, mesh, class_axes, num_classes)
    except ValueError as e:
        assert holds_it and f"label {num_classes} at batch index {last} is outside" in str(e), e
    else:
        assert not holds_it, f"process {jax.process_index()} holds label {last} = {num_classes} and let it pass"


def main(coordinator, num_processes, process_id, seed, out):
    distributed.initialize(coordinator, int(num_processes), int(process_id), heartbeat_timeout=30)
    assert jax.process_count() == int(num_processes) and jax.device_count() == 8, jax.devices()
    mesh = make_mesh(*MESH)
    results = {}
    for name, class_axes in LAYOUTS.items():
        head, x = fc_problem(int(seed), mesh, class_axes)
        weight = place(x["weight"], weight_sharding(mesh, class_axes))
        emb = place(x["emb"], jax.sharding.NamedSharding(mesh, BATCH_ROWS))
        labels = place(x["labels"], batch_sharding(mesh))

        check_inputs_per_process(emb, weight, x["labels"], mesh, class_axes, head.num_classes)

        def loss_fn(e, w, l):
            return sharded_margin_loss(e, w, l, head.margin, mesh=mesh, class_axes=class_axes,
                                       num_classes=head.num_classes)

        loss, (g_emb, g_w) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(emb, weight, labels)
        state = SparseState((place(x["slot"], weight_sharding(mesh, class_axes)),), x["count"])
        sample = jax.jit(head.sample)(jax.random.key(x["key"]), labels)
        step = jax.jit(lambda w, s, e, l, smp: head.step(w, s, e, l, smp, x["lr"]))
        step_loss, d_emb, new_w, new_state = step(weight, state, emb, labels, sample)
        for key, value in dict(loss=loss, g_emb=g_emb, g_w=g_w, step_loss=step_loss, d_emb=d_emb, new_w=new_w,
                               new_slot=new_state.slots[0], new_count=new_state.count, rows=sample.rows).items():
            results[f"{name}/{key}"] = gathered(value)
    results["summed"] = np.asarray(distributed.summed_over_processes(jax.process_index() + 1))
    if jax.process_index() == 0:
        np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
