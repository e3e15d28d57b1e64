"""A runnable example of the sharded margin loss: ``python -m jaxcls.demo``.

Learns a linear embedding of a synthetic many-class problem with CosFace on a
(data=2, class=4) mesh. With no accelerator it runs on 8 simulated CPU devices.
"""

import jax
import numpy as np
import optax

from jaxcls import batch_sharding, make_mesh
from jaxcls.losses import cosface, init_weight, sharded_margin_loss
from jaxcls.startup import simulate_cpu_devices


def main(num_classes: int = 10_000, dim: int = 64, batch: int = 512, steps: int = 60) -> list[float]:
    """Train for ``steps`` steps, printing the loss every 10; returns every step's loss."""
    devices = jax.devices()
    mesh = make_mesh(data=2, classes=len(devices) // 2) if len(devices) % 2 == 0 else make_mesh()
    print(f"mesh {dict(mesh.shape)} on {devices[0].platform}, {num_classes} classes")
    rng = np.random.default_rng(0)
    prototypes = rng.normal(size=(num_classes, 128)).astype(np.float32)  # class means in input space

    params = {"proj": 0.1 * jax.random.normal(jax.random.key(1), (128, dim)),
              "fc": init_weight(jax.random.key(2), num_classes, dim, mesh)}
    optimizer = optax.sgd(0.5, momentum=0.9)
    opt_state = optimizer.init(params)
    margin = cosface(s=32.0, m=0.2)

    def loss_fn(params, x, y):
        return sharded_margin_loss(x @ params["proj"], params["fc"], y, margin, mesh=mesh, num_classes=num_classes)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(steps):
        y = rng.integers(0, num_classes, size=batch).astype(np.int32)
        x = prototypes[y] + 0.5 * rng.normal(size=(batch, 128)).astype(np.float32)
        x, y = jax.device_put((x, y), batch_sharding(mesh))
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    simulate_cpu_devices(8)  # used where JAX finds no accelerator
    main()
