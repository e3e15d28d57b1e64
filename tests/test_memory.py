"""The compiled step's memory by part, its affine fit in the class count, and the check against a device's limit."""

import functools

import jax
import pytest
from tiny import get_config

from jaxcls.config import MAX_CLASSES, validate
from jaxcls.plan import memory
from jaxcls.plan.memory import (DoesNotFit, check_fits, fit_classes, format_bytes, max_classes_that_fit, parse_bytes,
    step_memory)
from jaxcls.run import build


def tiny_run(num_classes=64, devices=8, **overrides):
    config = get_config(num_classes=num_classes, **overrides)
    return build(config, jax.devices()[:devices], with_data=False)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_data, class_axes, fc_dtype, optimizer, fc_state_dtype", [
    (1, "data,class", "float32", "adamw", "same"), (2, "class", "bfloat16", "adamw", "float32"),
    (2, "class", "bfloat16", "sgd", "int8")])
def test_parts_are_the_shards_each_device_holds_and_sum_to_xla_total(mesh_data, class_axes, fc_dtype, optimizer,
                                                                      fc_state_dtype):
    run = tiny_run(num_classes=1000, mesh_data=mesh_data, class_axes=class_axes, fc_dtype=fc_dtype,
                   optimizer=optimizer, fc_state_dtype=fc_state_dtype)
    compiled = run.compile_step(run.abstract_state)
    parts = step_memory(run, compiled).parts
    c, shards = run.config, 8 // mesh_data if class_axes == "class" else 8
    rows = -(-1000 // shards)
    itemsize = 2 if fc_dtype == "bfloat16" else 4
    assert parts["FC weight"] == rows * c.num_features * itemsize
    # AdamW: m and v; SGD: the momentum, int8 with a float32 scale per row; and a step count
    state_row = 2 * c.num_features * (4 if fc_state_dtype == "float32" else itemsize) if optimizer == "adamw" \
        else c.num_features + 4
    assert parts["FC optimizer state"] == rows * state_row + 4
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.abstract_state["params"]))
    assert parts["backbone parameters"] == params  # replicated: every device holds all of them
    assert parts["backbone optimizer state"] > (params if optimizer == "adamw" else 0)  # AdamW's two moments
    per_device = c.batch_size // 8
    assert parts["input batch"] == per_device * c.data.input_size ** 2 * 3 + per_device * 4
    stats = compiled.memory_analysis()
    assert sum(parts.values()) == (stats.argument_size_in_bytes + stats.temp_size_in_bytes
                                   + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    assert parts["outputs not donated"] < 4096  # the state is donated: only the metrics come out new


@pytest.mark.slow
@pytest.mark.parametrize("fc_dtype, classes", [("float32", 8 * 4096), ("bfloat16", 8 * 65536)])
def test_the_tests_emitter_flag_keeps_the_steps_buffers(fc_dtype, classes):
    """conftest compiles with XLA:CPU's elemental emitter (``--xla_cpu_use_fusion_emitters=false``, for faster
    compiles) where a user's program gets the fusion emitters: the memory tests speak for users' programs only while
    the step's buffers are the same. Arguments, outputs and aliasing (the state updated in place) equal, temporaries
    within 1 KiB (~0.3 KiB seen). A bfloat16 FC state needs the elemental emitter on CPU, which ``Run.compile_step``
    puts over the caller's options (``FCHead.compiler_options``), so there both compiles get it: that case checks that
    ``compile_step`` applies it (without it the fusion emitters' step holds a copy of the weight, docs/benchmarks.md,
    "XLA:CPU and a 16-bit FC weight"; at 65,536 rows a device that exceeds the step's peak elsewhere: 7.7 MB)."""
    run = tiny_run(num_classes=classes, chunk_size=1024, sample_rate=0.5, optimizer="adamw", fc_dtype=fc_dtype,
                   fc_state_dtype="float32")
    compiled = [run.compile_step(run.abstract_state, {"xla_cpu_use_fusion_emitters": on}) for on in (True, False)]
    users, tests = (c.memory_analysis() for c in compiled)
    assert (users.alias_size_in_bytes, users.argument_size_in_bytes, users.output_size_in_bytes) == (
        tests.alias_size_in_bytes, tests.argument_size_in_bytes, tests.output_size_in_bytes)
    parts = step_memory(run, compiled[0]).parts
    assert users.alias_size_in_bytes >= parts["FC weight"] + parts["FC optimizer state"]
    assert abs(users.temp_size_in_bytes - tests.temp_size_in_bytes) <= 1024


@pytest.mark.slow
def test_bytes_are_affine_in_the_class_count_and_max_classes_is_the_largest_that_fits():
    memory_at = functools.cache(lambda classes: step_memory(tiny_run(classes, sample_rate=0.5, chunk_size=256)))
    a, b = fit_classes(memory_at, (8 * 2**20, 8 * 2**21))  # PartialFC samples full tiles: temporaries are fixed
    row = 2 * 32 * 4  # weight + momentum, float32, D = 32
    assert 0 < a and row <= b * 8 <= row + 32  # and PartialFC's sampling: a few 4-byte values per row
    limit = int(a + b * 8 * 3_000_000)
    classes, fitting, fixed, per_class, capped = max_classes_that_fit(memory_at, limit, shards=8)  # a third compile
    assert not capped
    assert (fixed, per_class) == (a, b)  # from the same probes
    assert fitting.total == pytest.approx(a + b * classes, rel=1e-4)  # affine beyond the probes (a third compile)
    assert classes % 8 == 0 and fitting.total <= limit
    # the largest: 8 more classes (a row more per device) would not fit; 1 KiB for alignment off the line
    # (measured: 117 B off it at 3M classes, 155 B to spare where a row needs 272)
    assert limit - fitting.total < b * 8 + 1024, (limit, fitting.total, b)


def test_max_classes_stops_at_the_largest_count_int32_labels_take():
    """2^31 classes would overflow the labels (the planner's solve once landed past it and failed after minutes of
    compiling); config validation refuses such a num_classes by name."""
    fake = lambda classes: memory.StepMemory({"FC weight": 1000 + classes}, "cpu")  # a byte a class
    fit = max_classes_that_fit(fake, limit=2**40, shards=16)
    assert fit.capped and fit.classes == MAX_CLASSES // 16 * 16 and fit.classes <= 2**31 - 2**16
    assert not max_classes_that_fit(fake, limit=2**30, shards=16).capped
    config = get_config(num_classes=2**31)
    with pytest.raises(ValueError, match=r"^num_classes must be in \[1, 2,147,418,112\] \(int32 labels\), got"):
        validate(config, num_devices=8)


def test_max_classes_steps_down_until_a_count_fits_and_says_when_none_does():
    """Off the fit's line (temporaries that grow faster beyond the probes), the solved count is stepped down by whole
    rows per device until its compile fits, however small the excess (it was cut to whole classes first, so an
    excess under one class's bytes left the count as it was, over the limit); where not even the fixed part fits,
    ``DoesNotFit`` after the two probes, not a num_classes of 0 or less."""
    shards, asked = 8, []

    def fake(classes, a=10_000, b=3.0, bump=40_000):  # 3 B a class; past 2^22 rows per device, 40 kB more
        asked.append(classes)
        return memory.StepMemory({"FC weight": a + b * classes + (bump if classes > shards * 2**22 else 0)}, "cpu")

    limit = 10_000 + 3 * shards * 2**24
    fit = max_classes_that_fit(fake, limit, shards)
    assert fit.memory.total <= limit and fit.classes % shards == 0 and len(asked) == 4
    assert fake(fit.classes + shards).total > limit  # the largest: a row more per device does not fit
    small = lambda classes: fake(classes, bump=1)  # 1 B over the line: less than one class
    fit = max_classes_that_fit(small, limit, shards)
    assert fit.memory.total <= limit and small(fit.classes + shards).total > limit
    asked.clear()
    with pytest.raises(memory.DoesNotFit, match=r"not even 8 classes \(one FC row per device\) fit"):
        max_classes_that_fit(fake, limit=9_000, shards=shards)
    assert len(asked) == 2  # the probes alone
    asked.clear()
    max_classes_that_fit(fake, limit=2**40, shards=2**12)  # many shards: the probes stay within int32 labels
    assert max(asked[:2]) <= MAX_CLASSES


def test_check_fits_raises_with_the_plan_where_the_device_reports_a_limit(monkeypatch):
    used = memory.StepMemory({part: 2**20 for part in memory.PARTS}, "cpu")
    assert check_fits(used, jax.devices()) is None  # a CPU reports no limit: nothing to check
    monkeypatch.setattr(memory, "device_limit", lambda devices: used.total - 1)
    with pytest.raises(DoesNotFit, match=r"needs .* per device, more than the") as error:
        check_fits(used, jax.devices())
    assert any("FC weight" in line for line in error.value.details)
    assert any("total per device" in line and "(100%)" in line for line in error.value.details)
    monkeypatch.setattr(memory, "device_limit", lambda devices: 2 * used.total)
    assert "(50%)" in check_fits(used, jax.devices())


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("1.5MiB", 3 * 2**19),
                                            ("1024", 1024), ("2TiB", 2 * 2**40)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 GiBs", "lots", "-1GiB", "0"])
def test_parse_bytes_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 3 * 2**19, 80 * 2**30)] == ["512 B", "1.50 MiB", "80.00 GiB"]
