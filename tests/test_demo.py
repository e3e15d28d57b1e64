"""``python -m jaxcls.demo``: the sharded loss in a user's own optax loop learns."""

import numpy as np

from jaxcls.demo import main


def test_demo_learns(capsys):
    losses = main(num_classes=1000, dim=16, batch=64, steps=25)
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    assert "mesh {'data': 2, 'class': 4} on cpu, 1000 classes" in capsys.readouterr().out
