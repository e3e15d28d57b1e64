"""Every benchmark's --small mode runs and writes well-formed JSON (no timing asserts); the scripts stand alone."""

import ast
import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import COMPILATION_CACHE, GPU_KERNEL_CACHE, TEST_COMPILE_FLAGS
from jaxcls.bench import RowFailed, in_fresh_process
from jaxcls.config import benchmark_config, validate

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "loss.py": {"loss", "ms", "temp_bytes"},
    "fc_memory.py": {"C", "sample_rate", "dtype", "temp_bytes", "bytes_per_class"},
    "backbone_memory.py": {"model", "dtype", "remat", "saved_bytes", "temp_bytes"},
    "step_throughput.py": {"model", "batch", "classes", "img_per_s", "temp_bytes", "bn_backward"},
    "max_classes.py": {"classes", "img_per_s", "is_max"},
    "input_pipeline.py": {"stage", "threads", "img_per_s"},
    "cross_host.py": {"class_axes", "mesh", "cross_host_MB_per_host", "collectives"},
    "inference_runtimes.py": {"runtime", "model", "batch", "img_per_s", "max_rel_err"},
    "planner_vs_device.py": {"model", "classes", "planner_GiB", "planner_parts", "device_GiB", "peak_GiB"},
    "gpu_plan.py": {"model", "fc_state_dtype", "gpus", "fixed_GiB", "bytes_per_class", "max_classes_75",
                    "max_classes_95"},
    "gpu_program.py": {"program", "kind", "kernels", "result_MiB", "moved_GiB"},
    "profile_step.py": {"program", "wall_ms", "device_ms", "fusion_ms", "ms_by_source", "ops_by_source"},
    "fc_rounding.py": {"fc_dtype", "fc_weight_rounding", "loss_last", "moved_positive", "moved_other",
                       "off_float32_active", "off_float32_other", "top1", "probe_loss"},
    "mbf_convolutions.py": {"part", "lowering", "batch"},
    "fc_bytes_per_row.py": {"fc_dtype", "fc_weight_rounding", "sampled_rows", "moved_bytes", "kb_per_sampled_row",
                            "floor_kb"},
    "fc_kernels.py": {"kernel", "case", "form", "ms", "least_GB_per_s", "diff_vs_xla"},
    "partialfc_draw.py": {"classes", "rows", "form", "ms", "temp_bytes_per_class"},
    "device_ceilings.py": {"measure", "size", "ms"},
    "trace_time.py": {"model", "target", "trace_s", "lower_s", "trace_s_first", "lower_s_first"},
}
NEEDS = {"inference_runtimes.py": "jax2onnx"}
# what a script's --small run takes besides (fc_kernels.py: two of the kernel form's variants, two update cases;
# step_throughput.py: BatchNorm's backward by autodiff, the form the default run does not trace)
SMALL_ARGS = {"fc_kernels.py": ["--fc-kernels", "pallas,pallas_update", "--update", "sgd/bfloat16/int8",
                                "--update", "adamw/float32/float32"],
              "step_throughput.py": ["--bn-backward", "autodiff"]}
GPU_TARGET = {"gpu_plan.py", "gpu_program.py"}  # compile for a GPU: JAX's CUDA plugin
# scripts that another test runs whole, checking their JSON as test_small_mode_writes_json would
RUN_ELSEWHERE = {"fc_bytes_per_row.py": "test_gpu_target.py::test_the_fc_path_moves_at_most_8_kb_per_sampled_row"}


def benchmark(name: str):
    """The script benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def script_env(compile_as_tests: bool = False) -> dict:
    """The environment a benchmark script runs in: it sets up its own devices (XLA_FLAGS without a device count), and
    programs that the tests already compiled for 8 devices come from the run's compilation cache, and kernels that
    they compiled for a GPU from its kernel file. With ``compile_as_tests`` its CPU programs compile as the tests' do
    (no LLVM optimization, XLA:CPU's elemental emitter: faster, and a --small run's timings count for nothing);
    without, XLA's defaults (programs compiled for a GPU)."""
    flags = " ".join((TEST_COMPILE_FLAGS if compile_as_tests else ()) + GPU_KERNEL_CACHE)
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"XLA_FLAGS": flags,
                                                                         "JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE}


def test_scripts_import_no_sibling_and_no_script_is_named_like_a_library_module():
    """A script's imports work without its folder on sys.path, and ``import <name>`` means one thing."""
    scripts = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    library = {path.stem for path in (ROOT / "jaxcls").rglob("*.py")} | {
        path.name for path in (ROOT / "jaxcls").rglob("*") if path.is_dir()}
    assert not scripts.keys() & library
    for name, path in scripts.items():
        nodes = list(ast.walk(ast.parse(path.read_text())))
        imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & scripts.keys(), f"{name} imports a sibling: {imported & scripts.keys()}"


def test_benchmark_config_reads_set_flags_as_python_values():
    config = benchmark_config(small=True, overrides=["bn_sync=True", "chunk_size=65536", "model=r34",
                                                     "data.input_size=64"], batch_size=64)
    assert (config.bn_sync, config.chunk_size, config.model, config.data.input_size, config.batch_size,
            config.precision, config.data.kind) == (True, 65536, "r34", 64, 64, "float32", "synthetic")


def test_in_fresh_process_returns_the_row_or_raises_with_the_error(tmp_path):
    (tmp_path / "rows.py").write_text("def row(a):\n    return {'a': a}\n\n\n"
                                      "def fails():\n    raise ValueError('no row')\n")
    spec = importlib.util.spec_from_file_location("rows", tmp_path / "rows.py")
    rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows)
    assert in_fresh_process(rows.row, [1, "x"]) == {"a": [1, "x"]}
    with pytest.raises(RowFailed, match="ValueError: no row"):
        in_fresh_process(rows.fails)


def test_a_rows_peak_is_its_own_or_none(monkeypatch):
    """The allocator's peak is the process's, never reset: a row that did not raise it gets None, not an earlier
    row's peak (loss.py's grid once wrote 34.4 GB for a chunked loss whose temporaries were 3.2 GB)."""
    import jaxcls.bench as bench
    peak = {"peak_bytes_in_use": 100}
    device = type("Device", (), {"memory_stats": lambda self: peak})()
    monkeypatch.setattr(bench.jax, "devices", lambda: [device])
    before = bench.peak_device_bytes()
    assert before == 100 and bench.peak_device_bytes(before) is None  # a row below the earlier peak
    peak["peak_bytes_in_use"] = 150
    assert bench.peak_device_bytes(before) == 150  # a row that set the peak
    device.memory_stats = lambda: None  # a CPU reports none
    assert bench.peak_device_bytes() is None and bench.peak_device_bytes(before) is None


def test_fc_state_accuracy_summarises_each_storage_over_its_seeds():
    script = benchmark("fc_state_accuracy")
    runs = [{"state": s, "seed": seed, "final": {"val/x/accuracy": a, "val/x/accuracy_std": 0.01}}
            for s, seed, a in [("float32", 0, 0.9), ("int8", 0, 0.8), ("float32", 1, 0.7)]]
    table = {row["state"]: row for row in script.summary(runs)}
    assert table["float32"]["seeds"] == [0, 1] and table["float32"]["accuracy"] == [0.9, 0.7]
    assert table["float32"]["mean"] == pytest.approx(0.8) and table["float32"]["sd"] == pytest.approx(0.1 * 2 ** 0.5)
    assert table["int8"]["mean"] == 0.8 and table["int8"]["sd"] is None


def test_fc_state_accuracy_storages_are_valid_glyphs_configs():
    """Each storage's overrides on configs/glyphs_r18.py pass the trainer's checks (a bad one would fail an hour in)."""
    spec = importlib.util.spec_from_file_location("glyphs_r18", ROOT / "configs" / "glyphs_r18.py")
    configs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configs)
    for overrides in benchmark("fc_state_accuracy").STATES.values():
        config = configs.get_config()
        config.update(overrides)
        validate(config, num_devices=8)


def test_fc_kernels_takes_the_variants_by_name_and_not_beside_a_setting_of_their_flags():
    script = benchmark("fc_kernels")
    assert script._variants([], ["rows_backward.GEMMS_IN_KERNELS=0"]) == [None]  # the module's flags, as set
    assert script._variants(["pallas_update", "pallas"], []) == ["pallas_update", "pallas"]
    with pytest.raises(SystemExit, match="--fc-kernels triton: expected one of pallas, pallas_update$"):
        script._variants(["pallas,triton"], [])
    with pytest.raises(SystemExit, match="--set rows_backward.GEMMS_IN_KERNELS=1: --fc-kernels sets "):
        script._variants(["pallas_update"], ["rows_backward.UPDATE_WARPS=4", "rows_backward.GEMMS_IN_KERNELS=1"])


def test_gpu_lease_logs_each_jobs_status_runs_fallbacks_resumes_and_carries_the_autotuning_cache(tmp_path):
    """benchmarks/gpu_lease.sh, as a lease runs it (here without a GPU, on sh: jobs): each job's own exit status in
    the log (it once logged rc=0 for every job), a ``|JOB`` only after a failure, a ``JOB @SECONDS`` under its own
    time limit, a second call skipping what the first finished (as it ended: a fallback still follows a failure),
    and XLA's autotuning results carried in from .gpucache and out in $OUT/autotune.tgz."""
    checkout, out = tmp_path / "checkout", tmp_path / "out"
    (checkout / ".gpucache" / "autotune" / "h100").mkdir(parents=True)
    (checkout / ".gpucache" / "autotune" / "h100" / "fusion.textproto").write_text("tuned")
    env = os.environ | {"OUT": str(out), "RESULTS": str(tmp_path / "results"),
                        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    jobs = ["sh:exit 3", "|sh:echo fallback-ran", "|sh:echo not-after-a-pass", "sh:echo $RESULTS > $RESULTS/seen",
            "sh:sleep 30 @1", "sh:echo under-its-own-limit @5"]

    def lease():
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_lease.sh"), *jobs], cwd=checkout, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    log = lease()
    outputs = log.splitlines()  # what the jobs printed, each on a line of its own
    assert "rc=3 after" in log.split("=== ")[2] and "fallback-ran" in outputs and "not-after-a-pass" not in outputs
    assert "skipped, the job before it passed: sh:echo not-after-a-pass" in log
    assert (tmp_path / "results" / "seen").read_text().strip() == str(tmp_path / "results")
    assert re.search(r"rc=124 after [12] s: sh:sleep 30 @1", log) and "under-its-own-limit" in outputs
    assert "autotuning cache: 1 entries carried" in log
    with tarfile.open(out / "autotune.tgz") as carried:
        assert "autotune/h100/fusion.textproto" in carried.getnames()
    again = lease()
    assert all(f"=== done in an earlier call (rc={rc}): {jobs[i].lstrip('|')}" in again
               for i, rc in ((0, 3), (1, 0), (3, 0), (4, 124), (5, 0)))
    # a call cut short during a fallback: on resume the failed job is still a failure, and its fallback runs
    done = tmp_path / "results" / "done.txt"
    done.write_text("".join(line + "\n" for line in done.read_text().splitlines() if "fallback-ran" not in line))
    assert "fallback-ran" in lease().splitlines()


def test_arcface_torchs_maximum_is_searched_from_a_bracket(rng):
    """benchmarks/arcface_torch_max_classes.py: the largest count that fits, within the resolution, from a count
    that runs and one that fails (tried first, and moved up while it fits), against thresholds drawn at random."""
    search = benchmark("arcface_torch_max_classes").largest_that_fits
    for _ in range(20):
        runs = int(rng.integers(1, 10**7))
        fails, resolution = runs + int(rng.integers(1, 10**7)), int(rng.integers(1, 10**6))
        limit = runs + int(rng.integers(0, 8 * (fails - runs)))  # at times beyond the bracket
        found = search(lambda count: count <= limit, runs, fails, resolution)
        assert found["max_classes"] <= limit < found["first_failing"], (found, limit)
        assert found["first_failing"] - found["max_classes"] <= resolution
        assert found["tried"][0] == [fails, fails <= limit]
        assert all(fit == (count <= limit) for count, fit in found["tried"])
    with pytest.raises(ValueError, match="expected 0 < runs < fails"):
        search(lambda count: True, 10, 10, 1)
    with pytest.raises(RuntimeError, match="still fit after 8 raises of the bracket"):
        search(lambda count: True, 10, 20, 1)  # a card without limit: no endless search
    with pytest.raises(RuntimeError, match="10 classes, the bracket's lower end, do not fit either"):
        search(lambda count: count < 5, 10, 20, 1)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed: pip install -e .[test]")
@pytest.mark.skipif(not (ROOT.parent / "shared" / "bench").is_dir(), reason="the arcface_torch bench is not beside "
                    "this checkout (../shared/bench)")
def test_arcface_torchs_maximum_needs_a_gpu_and_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would search its out-of-memory point")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "arcface_torch_max_classes.py"), "--bench",
                           str(ROOT.parent / "shared" / "bench"), "--runs", "8000000", "--fails", "10000000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().endswith("it needs a GPU"), proc.stderr[-2000:]


def test_the_sort_free_partialfc_draw_takes_the_rows_jaxcls_takes(rng):
    """benchmarks/partialfc_draw.py's candidate: top_rows is lax.top_k's rows, sorted, on keys with many ties at the
    threshold, few, all equal, for every count; and draw_keys orders the classes as jaxcls' sampler does."""
    import jax
    import jax.numpy as jnp

    from jaxcls import batch_sharding, make_mesh
    from jaxcls.fc.sampling import sample_budget, sample_classes

    script = benchmark("partialfc_draw")
    take = jax.jit(script.top_rows, static_argnums=1)
    for c in (1, 2, 67, 199):  # a few shapes (each count compiles anew), random keys
        for count in sorted({1, (c + 1) // 2, c}):
            for levels in (1, 2, 3, 7, 2**24):  # many ties at the threshold, few, all equal
                keys = jnp.asarray(rng.integers(0, levels, size=c), jnp.int32)
                np.testing.assert_array_equal(take(keys, count), script.by_sorting(keys, count), f"{keys} {count}")
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    c, key = int(rng.integers(500, 3000)), jax.random.key(int(rng.integers(2**31)))
    labels = rng.integers(0, c, size=16).astype(np.int32)
    budget = sample_budget(c, 16, 0.1)
    drawn = sample_classes(key, jax.device_put(labels, batch_sharding(mesh)), mesh=mesh, num_classes=c, num_rows=c,
                           sample_rate=0.1).rows
    keys = script.draw_keys(jax.random.fold_in(key, 0), jnp.asarray(labels), c)  # shard 0's key, as the sampler's
    np.testing.assert_array_equal(take(keys, budget), drawn)


@pytest.mark.parametrize("script, args, message", [
    ("fc_bytes_per_row", ["--loss-alone", "--batch", "64"],
     "--loss-alone measures N = 512, C = 1M, a float32 weight: --batch would be ignored"),
    ("input_pipeline", ["--root", "/no/such/folder"], "no train.rec in --root /no/such/folder"),
    ("input_pipeline", ["--small", "--root", "x"], "--small generates its own file: --root would be ignored"),
    ("fc_kernels", ["--registers", "--small", "--update", "sgd/float32/float32"],
     "--registers compiles every row kernel at the full sizes for an H100: --small, --update would be ignored"),
    ("fc_bytes_per_row", ["--loss-alone", "--target", "h300"], "argument --target: invalid choice: 'h300'")])
def test_an_option_a_script_would_not_use_is_refused(script, args, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    with pytest.raises(SystemExit) as exited:
        benchmark(script).main()
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("target, key, ms", [("h100", "ms_at_3.35_TB_per_s", 1.0), ("h200", "ms_at_4.8_TB_per_s",
                                                                                       3.35 / 4.8)])
def test_the_loss_alones_time_is_at_the_targets_own_bandwidth(target, key, ms, monkeypatch):
    """3.35 GB moved is 1 ms on an H100 (3.35 TB/s) and 0.70 ms on an H200 (4.8 TB/s), the key naming which."""
    script = benchmark("fc_bytes_per_row")
    monkeypatch.setattr(script, "loss_alone_bytes", lambda *args: (collections.Counter({"line": 3.35e9}), 0))
    rows = script.loss_alone_rows(None, target)
    assert len(rows) == 2 and all(row[key] == pytest.approx(ms) for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.gpu_target if s in GPU_TARGET else ())
                                    for s in sorted(SCRIPTS.keys() - RUN_ELSEWHERE)])
def test_small_mode_writes_json(script, tmp_path):
    if script in NEEDS and importlib.util.find_spec(NEEDS[script]) is None:
        pytest.skip(f"{script} needs {NEEDS[script]}: see docs/deploy.md")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--small", "--out", str(out),
                           *SMALL_ARGS.get(script, [])], cwd=ROOT,
                          env=script_env(script not in GPU_TARGET), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["backend"] and result["rows"]
    for row in result["rows"]:
        assert SCRIPTS[script] <= row.keys()
    if script == "fc_kernels.py":  # each variant in turn, beside XLA's form once; the statistics kernel in the first
        per_case = [(k, "xla", "") for k in ("stats", "embedding_grad", "backward")] + [
            ("stats", "pallas_interpret", "")] + [(k, "pallas_interpret", v) for k in ("embedding_grad", "backward")
                                                  for v in ("pallas", "pallas_update")]
        timed = sorted((r["kernel"], r["form"], r["variant"]) for r in result["rows"])
        assert timed == sorted(2 * per_case), timed  # two cases of each kernel
    if script == "step_throughput.py":
        assert {r["bn_backward"] for r in result["rows"]} == {"autodiff"}
    if script == "inference_runtimes.py":  # every runtime embeds as JAX does
        assert {r["runtime"] for r in result["rows"]} == {"jax", "stablehlo", "onnxruntime"}
        assert all(r["max_rel_err"] <= 1e-4 for r in result["rows"])


def test_prepare_lease_fills_what_a_lease_carries_and_refuses_what_it_cannot(tmp_path):
    """benchmarks/prepare_lease.sh in a checkout of its own: the bench copied into .gpudata, the wheels asked for
    (PIP stands in for pip), the newest lease's autotuning results, whatever its card, unpacked into .gpucache, the
    call to make printed; a missing bench, and a carry past the device tool's 64 MiB, refused with the reason."""
    checkout, shared = tmp_path / "checkout", tmp_path / "shared"
    (checkout / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "prepare_lease.sh", checkout / "benchmarks")

    def lease_archive(lease, content):
        tuned = tmp_path / lease / "autotune"
        tuned.mkdir(parents=True)
        (tuned / "fusion.textproto").write_text(content)
        (checkout / "docs" / "measurements" / lease).mkdir(parents=True)
        with tarfile.open(checkout / "docs" / "measurements" / lease / "autotune.tgz", "w:gz") as archive:
            archive.add(tuned, arcname="autotune")

    # by date, not by name: an H200's older lease sorts after an H100's newer one by name
    for lease, content in (("h100-2026-01-03", "newest"), ("h200-2026-01-02b", "older"), ("h200-2026-01-02", "old"),
                           ("h100-2026-01-01", "oldest")):
        lease_archive(lease, content)
    (checkout / ".gitignore").write_text(".whl/\n.gpudata/\n.gpucache/\n")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    pip = tmp_path / "pip"  # writes one file per package asked for into the -d folder
    pip.write_text('#!/bin/bash\nwhile [[ $1 != -d ]]; do shift; done; mkdir -p "$2"; d=$2; shift 2\n'
                   'for p in "$@"; do echo wheel > "$d/$p.whl"; done\n')
    pip.chmod(0o755)
    env = os.environ | {"PIP": str(pip)}

    def prepare():
        return subprocess.run(["bash", str(checkout / "benchmarks" / "prepare_lease.sh"), str(shared)], env=env,
                              capture_output=True, text=True, timeout=60)

    refused = prepare()
    assert refused.returncode == 1 and f"error: no arcface_torch bench at {shared}/bench" in refused.stderr
    (shared / "bench").mkdir(parents=True)
    (shared / "bench" / "arcface_torch_bench.py").write_text("# the bench")
    done = prepare()
    assert done.returncode == 0, done.stderr
    assert (checkout / ".gpudata" / "bench" / "arcface_torch_bench.py").read_text() == "# the bench"
    assert sorted(p.name for p in (checkout / ".whl").iterdir()) == [
        "array-record.whl", "grain.whl", "ml_collections.whl", "portpicker.whl", "simplejpeg.whl"]
    assert (checkout / ".gpucache" / "autotune" / "fusion.textproto").read_text() == "newest"
    assert 'JOB_LIMIT=200 bash benchmarks/gpu_lease.sh "${jobs[@]}"' in done.stdout
    lease_archive("h200-2026-01-04", "an H200's, newer")
    assert prepare().returncode == 0
    assert (checkout / ".gpucache" / "autotune" / "fusion.textproto").read_text() == "an H200's, newer"
    subprocess.run(["truncate", "-s", "65M", str(checkout / ".whl" / "huge.whl")], check=True)
    too_big = prepare()
    assert too_big.returncode == 1 and "error: more than the device tool carries" in too_big.stderr
