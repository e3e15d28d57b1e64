"""The configuration: every key known, every named choice and value checked before anything is built."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcls.config import (NAMED_CHOICES, RANGES, RESUMABLE_KEYS, base_config, check_batchnorm_rows, check_config_flags,
                           check_keys, flat_keys, from_json, get_key, plain, resume_differences,
                           validate)
from jaxcls.eval.evaluator import eval_bin_paths
from jaxcls.fc import DEFAULT_CHUNK
from jaxcls.run import build
from jaxcls.train import train
from tiny import from_command_line, get_config as tiny_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    validate(load(path), num_devices=8)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_an_override_of_one_key_of_a_shipped_config_changes_no_other_key(path):
    """Keys that follow another (eval_every from total_steps) must each hold their own reference: one object
    shared by two keys turned ``--config.eval_every=10`` into a 10-step run. The keys others follow by design
    (``batch_size``, ``total_steps``) are not overridden here; a root set on the command line moves the verification
    sets too."""
    before = plain(load(path))
    for key in flat_keys(load(path)):
        value = get_key(load(path), key)
        if key in ("batch_size", "total_steps") or not isinstance(value, int) or isinstance(value, bool):
            continue
        c = load(path)
        node, leaf = (c, key) if "." not in key else (get_key(c, key.rsplit(".", 1)[0]), key.rsplit(".", 1)[1])
        node[leaf] = value + 1
        changed = plain(c)
        assert [k for k in flat_keys(c) if get_key(changed, k) != get_key(before, k)] == [key]
    if path.name != "glyphs_finetune_gpu.py":  # its sets are glyphs' own, beside the half it trains on
        c = load(path)
        c.data.root = "/elsewhere"
        assert all(str(p).startswith("/elsewhere/") for p in eval_bin_paths(c))


# arcface_torch's configs/<name>.py at insightface's HEAD: (margin, m, sample_rate, weight decay, global batch, lr,
# warmup epochs, epochs); its train_v2.py decays the lr linearly after the warmup (PolynomialLRWarmup, power 1)
ARCFACE_TORCH = {"ms1mv3_r50": ("arcface", 0.5, 1.0, 5e-4, 128 * 8, 0.1, 0, 20),
                 "ms1mv3_mbf": ("arcface", 0.5, 1.0, 1e-4, 128 * 8, 0.1, 0, 40),
                 "glint360k_r100": ("cosface", 0.4, 1.0, 1e-4, 128 * 8, 0.1, 0, 20),
                 "wf42m_pfc02_32gpus_r50_bs4k": ("cosface", 0.4, 0.2, 5e-4, 128 * 32, 0.4, 2, 20)}


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH))
def test_a_face_recipe_is_arcface_torchs_config_of_its_name(name):
    c = load(Path(__file__).resolve().parents[1] / "configs" / f"{name}.py")
    margin, m, rate, decay, batch, lr, warmup, epochs = ARCFACE_TORCH[name]
    steps = c.total_steps // epochs
    assert (c.margin.name, c.margin.m, c.margin.s, c.sample_rate, c.weight_decay, c.batch_size, c.lr) == (
        margin, m, 64.0, rate, decay, batch, lr)
    assert (c.warmup_steps, c.total_steps, c.lr_power, c.optimizer, c.momentum) == (
        warmup * steps, epochs * steps, 1.0, "sgd", 0.9)
    c.data.root = "/data/elsewhere"  # the verification sets move with the data (arcface_torch's val_targets)
    assert [str(p) for p in eval_bin_paths(c)] == [f"/data/elsewhere/{n}.bin" for n in ("lfw", "cfp_fp", "agedb_30")]


def test_a_face_recipes_batch_set_on_the_command_line_keeps_its_epochs(monkeypatch):
    """arcface_torch counts steps from the global batch when it starts: ms1mv3_r50 at batch 128 is still 20 epochs of
    5,179,510 images (809,280 steps, not the 101,160 of batch 1,024); a step count given as well is taken as given."""
    path = Path(__file__).resolve().parents[1] / "configs" / "ms1mv3_r50.py"
    for extra, steps in [([], 5_179_510 // 128 * 20), (["--config.total_steps=500"], 500)]:
        config = from_command_line(monkeypatch, "--config.batch_size=128", *extra, config=path)
        assert (config.batch_size, config.total_steps) == (128, steps)
        assert from_json(config.to_json_best_effort()).total_steps == steps  # saved as the number
    c = load(path)
    c.batch_size, c.warmup_steps = 2048, 7
    assert (c.total_steps, c.warmup_steps) == (5_179_510 // 2048 * 20, 7)
    c.batch_size = 0  # refused as itself, before the step counts read through it divide by it
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        validate(c, 8)
    glyphs = load(path.parent / "glyphs_r50_gpu.py")
    glyphs.batch_size = 512  # its evaluations and checkpoints, at half and all of its steps, follow them
    assert glyphs.eval_every == glyphs.ckpt_every == glyphs.total_steps // 2 == 18_000 // 512 * 24 // 2
    wf42m = load(path.parent / "wf42m_pfc02_32gpus_r50_bs4k.py")
    wf42m.batch_size = 1024  # its 2 warmup epochs follow the batch too
    assert (wf42m.warmup_steps, wf42m.total_steps) == (42_474_557 // 1024 * 2, 42_474_557 // 1024 * 20)


def test_unknown_key():
    c = tiny_config()
    c.unlock()
    c.learning_rate = 0.1
    with pytest.raises(ValueError, match="unknown config key 'learning_rate'"):
        check_keys(c)
    c = tiny_config()
    c.data.unlock()
    c.data.rooot = "x"
    with pytest.raises(ValueError, match=r"unknown config key 'data.rooot' \(did you mean 'data.root'\?\)"):
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
    (dict(optimizer="adamw", fc_state_dtype="int8"), "adamw cannot keep its FC state in int8"),
    (dict(optimizer="adamw", fc_dtype="float16"), "adamw cannot keep its FC state in float16 .*rounds to 0"),
    (dict(optimizer="adamw", fc_state_dtype="float16"), "adamw cannot keep its FC state in float16"),
    (dict(optimizer="adamw", fc_dtype="bfloat16"),
     "adamw cannot keep its FC state in bfloat16 .*fc_state_dtype=float32"),
    (dict(fc_weight_rounding="stochastic"), "stochastic rounding is for a bfloat16 FC weight, not float32"),
    (dict(fc_dtype="float16", fc_weight_rounding="stochastic"), "for a bfloat16 FC weight, not float16"),
    (dict(fc_weight_rounding="up"), r"unknown FC weight rounding 'up'; choose one of \['nearest', 'stochastic'\]"),
])
def test_inconsistent_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(tiny_config(**overrides))


def test_training_needs_two_rows_per_batchnorm_and_the_trainer_says_so_before_it_starts(tmp_path):
    for overrides, devices in ((dict(batch_size=16), 8), (dict(batch_size=8, bn_sync=True), 8),  # 2 rows a device;
                               (dict(batch_size=4, accum_steps=2, bn_sync=True), 1)):  # statistics over all rows
        check_batchnorm_rows(tiny_config(**overrides), devices)
    for overrides, devices, words in ((dict(batch_size=8), 8, "device and micro-batch"),
                                      (dict(batch_size=32, accum_steps=4), 8, "device and micro-batch"),
                                      (dict(batch_size=4, accum_steps=4, bn_sync=True), 1, "micro-batch")):
        with pytest.raises(ValueError, match=rf"^batch_size {overrides['batch_size']} leaves BatchNorm one row per "
                                             rf"{words}: every embedding would be the same and the backbone get no "
                                             "gradient; give it at least 2 rows"):
            check_batchnorm_rows(tiny_config(**overrides), devices)
    validate(tiny_config(batch_size=8), num_devices=8)  # a run evaluated on more devices than it trained on
    with pytest.raises(ValueError, match=r"one row per device and micro-batch: .* \(or bn_sync=True\)$"):
        train(tiny_config(batch_size=8), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_fc_weight_rounding_reaches_the_fc_head_and_the_run_summary():
    run = build(tiny_config(fc_dtype="bfloat16", fc_weight_rounding="stochastic"), with_data=False)
    assert run.train_step.head.optimizer.weight_rounding == "stochastic"
    assert "FC 64 classes × 32 (bfloat16, rounded stochastically, optimizer state bfloat16)" in run.summary()[1]
    assert build(tiny_config(), with_data=False).train_step.head.optimizer.weight_rounding == "nearest"


def test_defaults():
    c = base_config()
    validate(c, num_devices=8)
    assert c.chunk_size == DEFAULT_CHUNK and c.data.kind == "procedural"


@pytest.mark.parametrize("key,rule,words", RANGES, ids=[k for k, _, _ in RANGES])
def test_every_numeric_key_is_range_checked(key, rule, words):
    c = base_config()
    node, leaf = (c, key) if "." not in key else (get_key(c, key.rsplit(".", 1)[0]), key.rsplit(".", 1)[1])
    for bad in (-1, -0.5, 0, 1, 1.5):
        if not rule(bad) and isinstance(bad, type(node[leaf])):  # ints for int keys; any number for float keys
            node[leaf] = bad
            with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be {re.escape(words)}, got {bad}$"):
                validate(c, num_devices=1)
            return
    pytest.fail(f"no out-of-range value tried for {key}")


def test_the_seed_and_the_loss_scale_are_checked_at_their_upper_ends():
    """The seed is an int32 argument of the initializer, as is seed + 1; the loss scale a float32."""
    for key, good, bad in [("seed", 2**31 - 2, 2**31 - 1), ("loss_scale.initial", 2.0**127, 1e39)]:
        c = base_config()
        node, leaf = (c, key) if "." not in key else (c.loss_scale, "initial")
        node[leaf] = good
        validate(c, num_devices=1)
        node[leaf] = bad
        with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be in .*, got {re.escape(str(bad))}$"):
            validate(c, num_devices=1)


def test_bad_records_policy_is_checked():
    c = base_config()
    c.data.bad_records = "sometimes"
    with pytest.raises(ValueError, match="unknown data.bad_records policy 'sometimes'; choose 'error' or 'skip'"):
        validate(c, num_devices=1)


def test_command_line_keys_are_checked_with_the_closest_valid_key(tmp_path):
    tiny = str(Path(__file__).parent / "tiny.py")
    check_config_flags(["train", "--config", tiny, "--config.lr=0.2", "--config.model_kwargs.anything=1",
                        "--config.data.procedural.size=8", "--noconfig.data.flip"])
    with pytest.raises(ValueError, match=r"^unknown config key 'num_clases' \(did you mean 'num_classes'\?\)$"):
        check_config_flags(["train", "--config.num_clases=10"])
    with pytest.raises(ValueError, match=r"^unknown config key 'foo'$"):
        check_config_flags(["train", f"--config={tiny}", "--config.foo=1"])
    with pytest.raises(ValueError, match="config file 'nowhere.py' not found"):
        check_config_flags(["train", "--config", "nowhere.py"])


def test_list_valued_keys_are_settable_from_the_command_line(monkeypatch):
    for argv, expected in [(["--config.eval_bins=a.bin", "--config.eval_bins=b.bin"], ("a.bin", "b.bin")),
                           (["--config.eval_bins=('lfw.bin', 'cfp_fp.bin')"], ("lfw.bin", "cfp_fp.bin"))]:
        assert from_command_line(monkeypatch, *argv).eval_bins == expected


def test_a_config_that_changes_its_small_r18_changes_no_other():
    changed = tiny_config()
    changed.model_kwargs.stages[0] = 3
    assert tiny_config().model_kwargs.to_dict() == {"width": 8, "stages": [1, 1, 1, 2]}


def test_free_form_keys_can_be_added_from_the_command_line(monkeypatch):
    """``model_kwargs`` and ``data.procedural`` go to constructors as they are: ``--config.model_kwargs.dropout``
    adds a key the config file lacks (a bare AttributeError before), its value read as a literal."""
    config = from_command_line(monkeypatch, "--config.model_kwargs.dropout=0.2", "--config.model_kwargs.width", "24",
                               "--config.model_kwargs.act=prelu", "--noconfig.model_kwargs.bias",
                               "--config.data.procedural.size=8", "--config.lr=0.2")
    assert config.model_kwargs.to_dict() == dict(width=24, stages=[1, 1, 1, 2], dropout=0.2, act="prelu",
                                                        bias=False)
    assert config.data.procedural.size == 8 and config.lr == 0.2


def test_saved_config_reads_back_and_old_ones_get_new_defaults():
    c = tiny_config(eval_bins=("a.bin",), model="r34")
    again = from_json(c.to_json_best_effort())
    assert again.eval_bins == ("a.bin",) and resume_differences(again, c) == [] and again.to_dict() == c.to_dict()
    old = c.to_dict()
    del old["max_bad_steps"], old["data"]["bad_records"]  # written before these keys existed
    again = from_json(json.dumps(old))
    assert again.max_bad_steps == base_config().max_bad_steps and again.data.bad_records == "error"


def test_resume_refuses_what_changes_the_model_data_or_optimizer():
    saved = tiny_config()
    changed = tiny_config(model="r34", num_features=64, batch_size=64, seed=1, lr=0.2)
    changed.model_kwargs.width = 32
    assert resume_differences(saved, changed) == [
        "batch_size: 32 → 64", "lr: 0.1 → 0.2", "model: 'r18' → 'r34'",
        "model_kwargs: {'stages': [1, 1, 1, 2], 'width': 8} → {'stages': [1, 1, 1, 2], 'width': 32}",
        "num_features: 32 → 64", "seed: 0 → 1"]
    tuples = tiny_config()  # a free-form dict's tuple (IResNet's documented stages) is a list once saved as JSON
    tuples.model_kwargs = {"width": 8, "stages": (1, 1, 1, 2)}
    assert isinstance(tuples.model_kwargs.stages, tuple)
    assert resume_differences(from_json(tuples.to_json_best_effort()), tuples) == []
    tuples.model_kwargs = {"width": 8, "stages": (1, 1, 2, 2)}
    assert resume_differences(saved, tuples) == [
        "model_kwargs: {'stages': [1, 1, 1, 2], 'width': 8} → {'stages': [1, 1, 2, 2], 'width': 8}"]
    moved = tiny_config(mesh_data=2, class_axes="class", eval_every=5, ckpt_every=7, chunk_size=0, remat="full")
    moved.data.root, moved.data.threads = "/elsewhere", 1
    assert resume_differences(saved, moved) == []
    assert all(not k.startswith(("model", "num_", "lr", "batch", "optimizer", "seed")) for k in RESUMABLE_KEYS)


def cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", *args], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


def test_cli_errors_are_one_line(tmp_path):
    code, lines = cli("jaxcls.train", "--config", "tests/tiny.py", "--config.lrr=1", "--workdir", str(tmp_path))
    assert (code, lines) == (2, ["error: unknown config key 'lrr' (did you mean 'lr'?)"])
    code, lines = cli("jaxcls.train", "--config", "tests/tiny.py", "--config.lr=-0.1", "--workdir", str(tmp_path))
    assert code == 1 and lines == ["error: lr must be > 0, got -0.1 (--verbosity=1 for the traceback)"]
    assert not (tmp_path / "config.json").exists()  # written only once the run is built and valid
    code, lines = cli("jaxcls.eval", "--workdir", str(tmp_path))
    assert code == 1 and len(lines) == 1 and "config.json" in lines[0], lines
