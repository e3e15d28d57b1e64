"""Building a run from a config: state created in its shardings, abstract state, margins, summary."""

import jax
import numpy as np
import pytest
from PIL import Image

from jaxcls import weight_sharding
from jaxcls.config import validate
from jaxcls.losses import MARGINS, CombinedMargin
from jaxcls.run import build, make_margin
from tiny import from_command_line, get_config as tiny_config


@pytest.fixture(scope="module")
def run_and_state():
    run = build(tiny_config(sample_rate=0.5))
    return run, run.init_state()


def test_state_is_created_in_the_abstract_states_shardings(run_and_state):
    run, state = run_and_state
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(run.abstract_state)):
        assert leaf.shape == spec.shape and leaf.dtype == spec.dtype
        assert leaf.sharding.is_equivalent_to(spec.sharding, leaf.ndim)
    assert state["weight"].shape == (64, 32) and state["weight"].sharding.is_equivalent_to(
        weight_sharding(run.mesh), 2)
    assert all(s.sharding.is_equivalent_to(weight_sharding(run.mesh), 2) for s in state["fc_opt"].slots)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state["params"]))
    assert int(state["step"]) == 0


def test_init_is_deterministic_in_the_seed(run_and_state):
    run, state = run_and_state
    again = run.init_state()
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(again["params"])):
        np.testing.assert_array_equal(a, b)
    other = build(tiny_config(sample_rate=0.5, seed=1)).init_state()
    assert not np.array_equal(other["weight"], state["weight"])


def test_class_only_layout_and_data_axis():
    run = build(tiny_config(class_axes="class", mesh_data=2))
    assert dict(run.mesh.shape) == {"data": 2, "class": 4}
    assert run.abstract_state["weight"].sharding.is_equivalent_to(weight_sharding(run.mesh, ("class",)), 2)
    assert run.train_step.head.class_axes == ("class",)


def test_without_data_opens_nothing_but_generated_sources(tmp_path):
    c = tiny_config()
    c.data.kind, c.data.root = "recordio", str(tmp_path / "not-here")
    assert build(c, with_data=False).source is None
    with pytest.raises(FileNotFoundError):
        build(c)
    assert build(tiny_config(), with_data=False).source is not None  # procedural: made on the fly


@pytest.mark.parametrize("classes, batch, line", [
    (8 * 1000, 32, "PartialFC 0.5: 500 of 1,000 rows a shard\nmesh"),  # the rate as asked
    (8 * 1000, 800,
     "PartialFC 0.5: 800 of 1,000 rows a shard (0.8 in effect: never fewer than the global batch's 800)")])
def test_summary_gives_partialfcs_rate_in_effect(classes, batch, line):
    c = tiny_config(num_classes=classes, batch_size=batch, sample_rate=0.5)
    assert line in "\n".join(build(c, with_data=False).summary())


@pytest.mark.parametrize("height, width, note", [(16, 16, "input 16×16; augment"),
                                                  (32, 32, "input 16×16 (stored 32×32, resized); augment"),
                                                  (20, 16, "input 16×16 (stored 20×16, stretched to a square)")])
def test_summary_says_where_the_stored_images_are_resampled(tmp_path, height, width, note):
    """Every image is resampled to data.input_size (arcface_torch would not train on a 112×96 set at all): the run's
    data line says so from the first image."""
    for name in ("a/1.png", "b/1.png"):
        (tmp_path / name).parent.mkdir()
        Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(tmp_path / name)
    c = tiny_config()
    c.data.kind, c.data.root = "folder", str(tmp_path)
    assert note in build(c).summary()[-1]


def test_summary_names_the_resolved_run(run_and_state):
    text = "\n".join(run_and_state[0].summary())
    for part in ("model r18", "64 classes × 32", "8 class shards, 8 rows per device",
                 "PartialFC 0.5: 8 of 8 rows a shard (1 in effect: never fewer than the global batch's 32)",
                 "data=1 × class=8", "global batch 32 (4 per device)", "512 images of 64 classes",
                 "BatchNorm statistics per device"):
        assert part in text, (part, text)
    assert len(run_and_state[0].summary()) <= 6


@pytest.mark.parametrize("name", sorted(MARGINS))
@pytest.mark.parametrize("straight_through", [False, True])
def test_margin_from_config_honours_every_field(name, straight_through):
    m = (1.2, 0.3, 0.1) if name == "combined" else 0.3
    c = tiny_config(margin=dict(name=name, s=32.0, m=m, straight_through=straight_through))
    where_m_goes = {"arcface": dict(m2=0.3), "cosface": dict(m3=0.3), "am_softmax": dict(m3=0.3),
                    "sphereface": dict(m1=0.3), "combined": dict(m1=1.2, m2=0.3, m3=0.1)}
    assert set(where_m_goes) == set(MARGINS)
    assert make_margin(c.margin) == CombinedMargin(s=32.0, straight_through=straight_through, **where_m_goes[name])


def test_combined_margin_from_the_command_line_is_arcface_torchs_margin_list(monkeypatch):
    """``m = (m1, m2, m3)`` as arcface_torch's ``margin_list``, set on the command line over a config whose margin is
    a family with one number; the run's summary names it."""
    config = from_command_line(monkeypatch, "--config.margin.name=combined", "--config.margin.m=(1.1,0.25,0.15)")
    assert make_margin(config.margin) == CombinedMargin(s=16.0, m1=1.1, m2=0.25, m3=0.15)
    run = build(config, with_data=False)
    assert "combined s=16 m=(1.1, 0.25, 0.15)" in "\n".join(run.summary())


def test_a_margins_m_may_be_a_list_or_a_numpy_number():
    """As a Python config file or JSON may give them."""
    c = tiny_config(margin=dict(name="combined", s=64.0, m=[1.0, 0.3, 0.2], straight_through=False))
    validate(c, num_devices=1)
    assert make_margin(c.margin) == CombinedMargin(s=64.0, m1=1.0, m2=0.3, m3=0.2)
    assert "combined s=64 m=(1.0, 0.3, 0.2)" in "\n".join(build(c, with_data=False).summary())
    c.margin.update(name="arcface", m=np.float64(0.3))
    validate(c, num_devices=1)


@pytest.mark.parametrize("name,m,message", [
    ("combined", 0.5, r"margin 'combined' takes m = \(m1, m2, m3\), as arcface_torch's margin_list; got 0.5"),
    ("combined", (1.0, 0.5), r"takes m = \(m1, m2, m3\).*got \(1.0, 0.5\)"),
    ("combined", (0.0, 0.5, 0.0), "m1 > 0"),
    ("combined", (1.0, 3.2, 0.0), r"m2 must be in \[0, π\)"),
    ("combined", (1.0, 0.5, -0.1), r"^margin.m must be >= 0, got \(1.0, 0.5, -0.1\)$"),
    ("arcface", (1.0, 0.5, 0.0), r"margin 'arcface' takes one number m.*\(m1, m2, m3\) is margin 'combined'"),
])
def test_a_margin_that_cannot_work_is_refused_by_validate(name, m, message):
    c = tiny_config(margin=dict(name=name, s=64.0, m=m, straight_through=False))
    with pytest.raises(ValueError, match=message):
        validate(c, num_devices=1)
