"""The configuration: every key known, every named choice and value checked before anything is built."""

import importlib.util
from pathlib import Path

import pytest

from jaxcls.config import NAMED_CHOICES, base_config, check_keys, validate
from jaxcls.fc import DEFAULT_CHUNK
from jaxcls.run import build
from tiny import get_config as tiny_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    validate(load(path), num_devices=8)


def test_unknown_key():
    c = tiny_config()
    c.unlock()
    c.learning_rate = 0.1
    with pytest.raises(ValueError, match="unknown config key 'learning_rate'"):
        check_keys(c)
    c = tiny_config()
    c.data.unlock()
    c.data.rooot = "x"
    with pytest.raises(ValueError, match="unknown config key 'data.rooot'"):
        check_keys(c)
    c = tiny_config(model_kwargs={"width": 8, "anything": 1})  # free-form: passed to the model as it is
    check_keys(c)


@pytest.mark.parametrize("key,table,what", NAMED_CHOICES, ids=[k for k, _, _ in NAMED_CHOICES])
def test_unknown_names_are_refused_before_any_data_is_opened(key, table, what, tmp_path):
    c = tiny_config()
    c.data.kind, c.data.root = "recordio", str(tmp_path / "missing")  # would fail if it were opened
    node, leaf = (c, key) if "." not in key else (c[key.split(".")[0]], key.split(".")[1])
    node[leaf] = "nonsense"
    with pytest.raises(ValueError, match=rf"unknown {what} 'nonsense'; choose one of \[.*'{sorted(table)[0]}'"):
        build(c)


@pytest.mark.parametrize("overrides,message", [
    (dict(batch_size=36), "batch_size 36 is not divisible by 8 devices"),
    (dict(batch_size=32, accum_steps=8), "not divisible by 8 devices × accum_steps 8"),
    (dict(sample_rate=0.0), r"sample_rate must be in \(0, 1\]"),
    (dict(sample_rate=1.5), r"sample_rate must be in \(0, 1\]"),
    (dict(mesh_data=3), "mesh_data 3 does not divide the 8 devices"),
    (dict(warmup_steps=6), "warmup_steps 6 must be below total_steps 6"),
    (dict(num_classes=10), "num_classes 10 is smaller than the 64 classes in the data"),
])
def test_inconsistent_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(tiny_config(**overrides))


def test_defaults():
    c = base_config()
    validate(c, num_devices=8)
    assert c.chunk_size == DEFAULT_CHUNK and c.data.kind == "procedural"
