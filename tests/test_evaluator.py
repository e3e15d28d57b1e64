"""Verification of a run's state on its configured sets, in eval mode, batch split over the devices."""

import io
import pickle

import numpy as np
import pytest
from PIL import Image

from conftest import jaxcls_records
from jaxcls.eval.evaluator import Evaluator, eval_sets
from jaxcls.run import build
from tiny import get_config as tiny_config

pytestmark = pytest.mark.slow  # compiles a run's initializer and its eval-mode backbone


@pytest.fixture(scope="module")
def run_and_state():
    run = build(tiny_config(eval_batch_size=20))
    return run, run.init_state()


def write_bin(path, images, issame):
    def png(image):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "PNG")
        return buf.getvalue()

    path.write_bytes(pickle.dumps(([png(im) for im in images], list(issame))))


def test_sets_are_the_bins_and_the_generated_heldout_pairs(tmp_path, run_and_state):
    run, _ = run_and_state
    images = np.random.default_rng(0).integers(0, 256, (8, 24, 24, 3), dtype=np.uint8)
    write_bin(tmp_path / "mini.bin", images, [True, False, True, False])
    config = tiny_config(eval_bins=(str(tmp_path / "mini.bin"),))
    (name, loaded, issame), (heldout, *_) = eval_sets(config, run.source)
    assert (name, heldout) == ("mini", "heldout") and loaded.shape == (8, 16, 16, 3)  # resized to the input size
    assert issame.tolist() == [True, False, True, False]
    assert eval_sets(config, None)[0][0] == "mini"
    bare = tiny_config(eval_bins=("mini.bin",))  # a bare name is in data.root, as arcface_torch's val_targets
    bare.data.root = str(tmp_path)
    assert eval_sets(bare, None)[0][1].shape == (8, 16, 16, 3)


def test_two_sets_of_one_name_are_refused_before_either_is_read(tmp_path, run_and_state):
    """Results are keyed by a set's name: a second ``lfw.bin`` (or a ``heldout.bin`` beside the generated pairs)
    would overwrite the first's. Neither file exists: nothing is read before the refusal."""
    run, _ = run_and_state
    first, second = tmp_path / "a" / "lfw.bin", tmp_path / "b" / "lfw.bin"
    with pytest.raises(ValueError, match=rf"two verification sets are named 'lfw' \({first} and {second}\)"):
        eval_sets(tiny_config(eval_bins=(str(first), str(second))), None)
    heldout = tmp_path / "heldout.bin"
    with pytest.raises(ValueError, match=rf"named 'heldout' \({heldout} and the data source's held-out pairs\)"):
        eval_sets(tiny_config(eval_bins=(str(heldout),)), run.source)
    with pytest.raises(FileNotFoundError):  # without the generated pairs, heldout.bin is a name like any other
        eval_sets(tiny_config(eval_bins=(str(heldout),)), None)


def test_embeddings_use_running_statistics(run_and_state):
    """In eval mode an image's embedding does not depend on the rest of the batch (BatchNorm uses its running
    statistics), and the batch is padded up to a multiple of the devices."""
    run, state = run_and_state
    evaluator = Evaluator(run)
    assert evaluator.batch == 24
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8) for _ in range(2))
    b[0] = a[0]
    emb_a, emb_b = np.asarray(evaluator.embed(state, a)), np.asarray(evaluator.embed(state, b))
    assert emb_a.shape == (8, 32) and emb_a.dtype == np.float32
    np.testing.assert_allclose(emb_a[0], emb_b[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(emb_a[1], emb_b[1])


def test_metrics_and_collapse_warning(run_and_state, caplog):
    run, state = run_and_state
    evaluator = Evaluator(build(tiny_config(collapse_warning=0.0)))  # any embedding "collapses"
    embeddings = evaluator.embeddings(state)
    with jaxcls_records(caplog):
        results = evaluator.metrics(embeddings)
    assert set(results) == {f"val/heldout/{k}" for k in ("accuracy", "accuracy_std", "best_threshold", "xnorm",
                                                          "mean_cosine", "auc", "impostor_pairs", "tar@far=1e-01",
                                                          "tar@far=1e-02")}  # 300 impostor pairs: FAR ≥ 1/300
    assert 0.0 <= results["val/heldout/accuracy"] <= 1.0 and results["val/heldout/xnorm"] > 0
    assert "embedding collapse on heldout" in caplog.text
    # the warning follows the set's mean cosine: none with the threshold just above it
    evaluator.config.collapse_warning = results["val/heldout/mean_cosine"] + 1e-6
    caplog.clear()
    with jaxcls_records(caplog):
        evaluator.metrics(embeddings)
    assert "embedding collapse" not in caplog.text
    evaluator.config.collapse_warning = results["val/heldout/mean_cosine"] - 1e-6
    with jaxcls_records(caplog):
        evaluator.metrics(embeddings)
    assert "embedding collapse on heldout" in caplog.text


def test_non_finite_embeddings_are_warned_of_and_their_set_is_nan(run_and_state, caplog):
    run, _ = run_and_state
    views = np.random.default_rng(2).normal(size=(2, 20, 32))
    views[0, 3] = np.nan
    with jaxcls_records(caplog):
        results = Evaluator(run).metrics({"lfw": (views, np.arange(10) % 2 == 0)})
    assert results["val/lfw/non_finite"] == 1 and np.isnan(results["val/lfw/accuracy"])
    assert "lfw: 1 of its 20 images have non-finite embeddings" in caplog.text
