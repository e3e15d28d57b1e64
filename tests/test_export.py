"""Backbone-only export: what ``load_backbone`` rebuilds embeds exactly as the run's eval mode."""

import numpy as np
import pytest

from jaxcls.data.pipeline import normalize
from jaxcls.eval.evaluator import Evaluator
from jaxcls.export import export_backbone, load_backbone
from jaxcls.run import build
from tiny import get_config as tiny_config

pytestmark = pytest.mark.slow  # compiles a run's initializer and its eval-mode backbone


def test_exported_backbone_gives_the_runs_eval_embeddings(tmp_path):
    config = tiny_config()
    run = build(config)
    state = run.init_state()
    export_backbone(config, state, tmp_path / "exported")
    model = load_backbone(tmp_path / "exported")
    images = np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8)
    np.testing.assert_allclose(model(normalize(images)), Evaluator(run).embed(state, images), rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == ["backbone", "config.json"]
