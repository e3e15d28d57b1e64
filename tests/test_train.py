"""The trainer end to end: a glyphs run, exact resume on the same and other meshes, the quiet CLI, the eval CLI."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import COMPILATION_CACHE, jaxcls_records
from jaxcls.checkpoint import CheckpointError, RunCheckpoints
from jaxcls.interrupts import Preempted, StopRequests
from jaxcls.run import build
from jaxcls.train import Diverged, check_init_from, initialized_from, train
from jaxcls.workdir import WorkdirLock, WorkdirLocked
from test_recordio import GLYPHS, needs_glyphs
from tiny import get_config as tiny_config, saved_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BAR = re.compile(r"\d+/\d+ \[|^\s*\d+%\|")  # tqdm redraws one line with \r


def as_numpy(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def losses(workdir):
    return [json.loads(line)["loss"] for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@needs_glyphs
def test_glyphs_smoke_on_2x4_mesh(tmp_path):
    c = tiny_config(num_classes=1500, mesh_data=2, batch_size=64, total_steps=40, warmup_steps=5, ckpt_every=100,
                    sample_rate=0.5, lr=0.2)  # at lr 0.1 the loss falls by ~1 in 40 steps: too close to call
    c.data.kind, c.data.root, c.data.input_size = "recordio", str(GLYPHS), 32
    c.margin.update(name="cosface", s=32.0, m=0.2, straight_through=False)
    state, last = train(c, tmp_path, progress=False)
    assert dict(state["weight"].sharding.mesh.shape) == {"data": 2, "class": 4}
    history = np.array(losses(tmp_path))
    assert len(history) == 40 and np.isfinite(history).all()
    # The loss first rises while the warm-up raises the lr (seen: 24 → 28 by step 15), then falls.
    assert np.polyfit(np.arange(20), history[20:], 1)[0] < 0, history
    assert history[-5:].mean() < history[10:20].mean() - 1.0, history
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["data"]["root"] == str(GLYPHS) and saved["mesh_data"] == 2


def test_resume_is_exact_and_works_on_another_mesh(tmp_path, caplog):
    c = tiny_config(sample_rate=0.5, bn_sync=True)  # global BatchNorm statistics: the same run on 8 and on 4 devices
    straight, _ = train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "resumed", progress=False, stop_after=3)
    caplog.set_level(logging.INFO, logger="jaxcls")
    with jaxcls_records(caplog):
        resumed, _ = train(c, tmp_path / "resumed", progress=False)
    assert f"resumed from step 3 in {tmp_path / 'resumed'}" in caplog.text
    assert int(resumed["step"]) == int(straight["step"]) == 6
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")

    # The 8-device checkpoint of step 3 continues on 4 devices with a (2, 2) mesh.
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "3", tmp_path / "moved" / "checkpoints" / "3")
    shutil.copy(tmp_path / "straight" / "config.json", tmp_path / "moved" / "config.json")
    state, _ = train(tiny_config(sample_rate=0.5, bn_sync=True, mesh_data=2), tmp_path / "moved", progress=False,
                     devices=jax.devices()[:4])
    assert dict(state["weight"].sharding.mesh.shape) == {"data": 2, "class": 2}
    assert int(state["step"]) == 6 and len(losses(tmp_path / "moved")) == 3
    np.testing.assert_allclose(losses(tmp_path / "moved"), losses(tmp_path / "straight")[3:], rtol=1e-4)


def test_resume_is_strict_and_init_from_takes_another_runs_backbone(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    c = tiny_config(sample_rate=0.5, total_steps=2, ckpt_every=1)  # the programs of the resume test: compiled once
    unfinished = tmp_path / "runs/relative/checkpoints/7.orbax-checkpoint-tmp-99"  # a save killed mid-way
    unfinished.mkdir(parents=True)
    (unfinished / "state").write_bytes(b"half a checkpoint")
    with jaxcls_records(caplog):
        train(c, "runs/relative", progress=False)
    assert "removed 1 unfinished checkpoint save(s) of an earlier process: 7.orbax-checkpoint-tmp-99" in caplog.text
    assert sorted(p.name for p in (tmp_path / "runs/relative/checkpoints").iterdir()) == ["1", "2"]
    saved_config = (tmp_path / "runs/relative/config.json").read_text()
    for change, shown in [(dict(num_classes=70), "num_classes: 64 → 70"), (dict(model="r34"), "model: 'r18' → 'r34'"),
                          (dict(num_features=64), "num_features: 32 → 64"),
                          (dict(model_kwargs={"width": 32}), "model_kwargs: {'stages': [1, 1, 1, 2], 'width': 8} → "
                                                             "{'stages': [1, 1, 1, 2], 'width': 32}"),
                          (dict(batch_size=64), "batch_size: 32 → 64")]:
        with pytest.raises(CheckpointError, match=rf"runs/relative holds a run with another config "
                                                  rf"\({re.escape(shown)}; total_steps: 2 → 4\): resume it with its"):
            train(tiny_config(sample_rate=0.5, total_steps=4, **change), "runs/relative", progress=False)
    assert (tmp_path / "runs/relative/config.json").read_text() == saved_config
    # refused before the training data is opened (a headerless .rec has every record's label read): data that is
    # not there gives the same error, as does another program holding the workdir
    elsewhere = tiny_config(sample_rate=0.5, total_steps=4)
    elsewhere.data.kind, elsewhere.data.root = "recordio", str(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"holds a run with another config \(data.kind: 'procedural'"):
        train(elsewhere, "runs/relative", progress=False)
    holder = WorkdirLock(tmp_path / "runs/relative", "another trainer")
    holder.acquire()
    try:
        with pytest.raises(WorkdirLocked, match="in use by another trainer"):
            train(elsewhere, "runs/relative", progress=False)
    finally:
        holder.release()

    # a new run (another class count) starts from step 1's backbone; the FC only with the same classes
    run = build(tiny_config(sample_rate=0.5, num_classes=80))
    fresh = run.init_state()
    started = initialized_from(run, fresh, "runs/relative:1", with_fc=False)
    source = RunCheckpoints("runs/relative/checkpoints", keep=3)
    step1, _ = source.restore(build(c).abstract_state, 1)
    source.close()
    for a, b in zip(jax.tree.leaves((started["params"], started["stats"])), jax.tree.leaves((step1["params"],
                                                                                            step1["stats"]))):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
    assert int(started["step"]) == 0 and started["weight"] is fresh["weight"]
    with pytest.raises(CheckpointError, match="--init_fc: runs/relative has an FC of 64 classes, this run 80"):
        check_init_from(run, "runs/relative", with_fc=True)
    wider = build(tiny_config(model_kwargs={"width": 16}))
    with pytest.raises(CheckpointError, match=r"relative/checkpoints/2 does not fit this run: params/\S+: shape"):
        initialized_from(wider, {}, "runs/relative", with_fc=False)


def test_a_bad_init_from_or_a_missing_eval_set_stops_the_run_before_it_compiles(tmp_path, monkeypatch):
    """Cheap inputs are checked before the train step is compiled, and another run's folder is never written."""
    monkeypatch.setattr("jaxcls.train.compile_fitting_step", lambda run: pytest.fail("the train step was compiled"))
    (tmp_path / "typo").mkdir()
    with pytest.raises(CheckpointError, match=rf"^--init_from {tmp_path}/typo: {tmp_path}/typo holds no run's "
                                              r"checkpoints$"):
        train(tiny_config(), tmp_path / "new", progress=False, init_from=str(tmp_path / "typo"))
    assert not any((tmp_path / "typo").iterdir())
    (tmp_path / "typo" / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match=r"typo holds no checkpoint$"):
        train(tiny_config(), tmp_path / "new", progress=False, init_from=f"{tmp_path / 'typo'}:3")
    with pytest.raises(ValueError, match=r"expected WORKDIR or WORKDIR:STEP with a step number$"):
        train(tiny_config(), tmp_path / "new", progress=False, init_from=f"{tmp_path / 'typo'}:last")
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        train(tiny_config(eval_bins=(str(tmp_path / "missing.bin"),)), tmp_path / "new", progress=False)


def test_divergence_stops_the_run_and_no_checkpoint_is_ever_non_finite(tmp_path, caplog):
    c = tiny_config(lr=1e8, clip_grad_norm=0.0, max_bad_steps=3, total_steps=40, ckpt_every=1, keep_checkpoints=40)
    with jaxcls_records(caplog), pytest.raises(
            Diverged, match=r"stopped at step (\d+): 3 steps in a row had a non-finite loss, gradient or update \(lr "
                            r"[\d.e+]+, grad norm \S+, loss .*\) and were skipped; last good checkpoint: "
                            r".*checkpoints/\d+$") as stopped:
        train(c, tmp_path, progress=False)
    warned = set(re.findall(r"step (\d+): non-finite loss, gradient or update; update skipped", caplog.text))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # a row per step, each counting the skipped steps up to and including its own
    assert rows[-1]["step"] == int(re.search(r"stopped at step (\d+)", str(stopped.value))[1])
    assert [r["skipped_steps"] for r in rows] == [sum(int(s) <= r["step"] for s in warned) for r in rows]
    assert rows[-1]["skipped_steps"] >= 3 and rows[0]["skipped_steps"] == 0
    series = RunCheckpoints(tmp_path / "checkpoints", keep=40)
    run = build(c)
    assert series.manager.all_steps()
    for step in series.manager.all_steps():
        state, _ = series.restore(run.abstract_state, step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves((state["params"], state["weight"], state["opt"])))
    series.close()


def cli(*args):
    """Run ``python -m <args>`` on 8 CPU devices sharing this process's compilation cache; (exit code, lines)."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ["XLA_FLAGS"])
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line.split("\r")[-1] for line in (proc.stdout + proc.stderr).splitlines()]
    return proc.returncode, [line for line in lines if line.strip() and not BAR.search(line)]


def test_cli_is_quiet_and_evaluates(tmp_path):
    flags = ["--config", "tests/tiny.py", "--workdir", str(tmp_path), "--config.sample_rate=0.5",
             "--config.eval_every=3", "--config.log_every=2"]
    code, lines = cli("jaxcls.train", *flags, "--config.total_steps=4")
    assert code == 0, "\n".join(lines)
    # a row every log step and every eval step (3 is not a log step), verification at each eval step and the last
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], "val/heldout/accuracy" in row) for row in rows] == [(2, False), (3, True), (4, True)]
    assert all(row["img_per_s"] > 0 for row in rows)
    assert 4 <= len(lines) <= 15, "\n".join(lines)
    assert not any(re.match(r"[IW]\d{4} ", line) for line in lines), "absl INFO lines leaked:\n" + "\n".join(lines)
    assert lines[0].startswith("model r18") and re.search(r"done: loss [\d.]+, verification heldout", lines[-1])
    metrics = (tmp_path / "metrics.jsonl").read_text()
    code, lines = cli("jaxcls.train", *flags, "--config.total_steps=4")  # again: the run is at its end
    assert code == 0 and lines == [f"{tmp_path} is at step 4 of 4 already: nothing to train"], "\n".join(lines)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics

    code, lines = cli("jaxcls.eval", "--workdir", str(tmp_path), "--roc")
    assert code == 0, "\n".join(lines)
    assert lines[0] == "step 4" and lines[2].startswith("heldout"), "\n".join(lines)
    assert "TAR@1e-04" in lines[1] and "heldout: TAR at FAR 1e-03, 1e-04 not measured: 300 impostor pairs" in "\n".join(lines)
    result = json.loads((tmp_path / "eval_4.json").read_text())
    assert 0.4 < result["val/heldout/accuracy"] <= 1.0 and 0 <= result["val/heldout/tar@far=1e-01"] <= 1
    assert (tmp_path / "roc_4.png").read_bytes().startswith(b"\x89PNG")

    # two runs (here the same one twice): each one's table, then the mean ± std over them
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-copy")
    code, lines = cli("jaxcls.eval", "--workdir", str(tmp_path), "--workdir", f"{tmp_path}-copy")
    assert code == 0, "\n".join(lines)
    assert lines.count("step 4") == 2 and "over 2 runs: mean ± sample std" in lines, "\n".join(lines)
    summary = lines[lines.index("over 2 runs: mean ± sample std") + 2]
    assert summary.split()[:4] == ["heldout", f"{result['val/heldout/accuracy']:.4f}", "±", "0.0000"], summary


def test_a_stop_request_ends_the_run_to_be_resumed_unless_it_comes_at_the_last_step(tmp_path, monkeypatch):
    """A SIGTERM (here: the stop requested after step ``at``) saves and raises ``Preempted`` (exit status 75, resume
    me), except after the last step: the run is complete, a requeue would find nothing to train."""
    c = tiny_config(sample_rate=0.5, total_steps=2, ckpt_every=1)  # the resume tests' program: compiled once
    for at, preempted in ((1, True), (2, False)):
        def now(self, step, at=at):
            self.received = self.received or ("SIGTERM" if step >= at else None)
            return self.received is not None

        monkeypatch.setattr(StopRequests, "now", now)
        workdir = tmp_path / f"at{at}"
        if preempted:
            with pytest.raises(Preempted, match=rf"stopped by SIGTERM after step 1; checkpoint saved in {workdir}"):
                train(c, workdir, progress=False)
        else:
            state, _ = train(c, workdir, progress=False)
            assert int(state["step"]) == 2
        assert RunCheckpoints(workdir / "checkpoints", 3).latest_step() == at


def test_eval_runs_on_a_device_count_the_training_batch_does_not_divide(tmp_path):
    """A run of batch 32 (trained on 8 devices here) evaluated on 3: the training batch and mesh play no part in an
    evaluation; the accuracy is the one on 8 devices. Nor does the FC's optimizer state: its config names one jaxcls
    no longer trains with (adamw's in bfloat16, refused since), as a run saved before would."""
    saved_run(tmp_path, tiny_config(), step=1)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, mesh_data=2, optimizer="adamw",  # on a (2, 4) mesh
                                                          fc_dtype="bfloat16", fc_state_dtype="same")))
    results = []
    for devices in (8, 3):
        flags = re.sub(r"(--xla_force_host_platform_device_count=)\d+", rf"\g<1>{devices}", os.environ["XLA_FLAGS"])
        proc = subprocess.run([sys.executable, "-m", "jaxcls.eval", "--workdir", str(tmp_path)], cwd=ROOT,
                              env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        written, = tmp_path.glob("eval_*.json")  # named by the state's step (a fresh state's: 0)
        results.append(json.loads(written.read_text()))
    assert results[0]["val/heldout/accuracy"] == pytest.approx(results[1]["val/heldout/accuracy"], abs=0.01)


def test_a_step_too_big_for_the_device_stops_before_any_state_with_the_plan(tmp_path):
    # a device reporting a 1 MiB limit (a CPU reports none): the CLI compiles the step, then stops with the plan
    script = ("import runpy, sys; import jaxcls.plan.memory as m; m.device_limit = lambda devices: 2**20; "
              f"sys.argv = ['jaxcls.train', '--config', 'tests/tiny.py', '--workdir', {str(tmp_path)!r}]; "
              "runpy.run_module('jaxcls.train', run_name='__main__')")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert re.match(r"error: the train step needs [\d.]+ MiB per device, more than the 1.00 MiB XLA may allocate on "
                    r"cpu \(--verbosity=1", lines[0]), proc.stderr
    assert any(l.strip().startswith("FC weight") for l in lines) and "python -m jaxcls.plan" in lines[-1]
    assert "--target <a GPU target like cpu> --devices 8 plans it for this GPU" in lines[-1]
    assert "Traceback" not in proc.stderr and not any((tmp_path / "checkpoints").iterdir())
    assert not (tmp_path / "config.json").exists()  # stopped before the run started


def wait_for_rows(workdir, rows, proc, timeout=300):
    """Wait until ``metrics.jsonl`` has ``rows`` rows (the subprocess is stepping)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (workdir / "metrics.jsonl").exists() and len(losses(workdir)) >= rows:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {rows} metrics rows: {proc.poll()=}")


def test_sigterm_saves_and_exits_75_and_a_second_trainer_is_refused(tmp_path):
    flags = ["--config", "tests/tiny.py", "--workdir", str(tmp_path), "--config.total_steps=100000",
             "--config.ckpt_every=100000", "--config.warmup_steps=1"]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ["XLA_FLAGS"])
    first = subprocess.Popen([sys.executable, "-m", "jaxcls.train", *flags], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_rows(tmp_path, 3, first)
        code, lines = cli("jaxcls.train", *flags)
        assert code == 1 and re.match(rf"error: {tmp_path} is in use by jaxcls.train pid {first.pid} on ", lines[-1]), lines
        first.send_signal(signal.SIGTERM)
        out = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    assert first.returncode == 75, out
    step = int(re.search(rf"stopped by SIGTERM after step (\d+); checkpoint saved in {tmp_path}/checkpoints/(\d+): run "
                         r"the same command to resume", out)[1])
    assert step >= 3 and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]
    assert not (tmp_path / "lock").exists() and "Traceback (most recent call last)" not in out


def test_signals_once_request_a_stop_and_a_second_ctrl_c_aborts():
    """``StopRequests`` in a process of its own (signal handlers belong to the main thread)."""
    script = """
import signal, time
from jaxcls.interrupts import StopRequests
before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in a background job
with StopRequests() as stop:  # raise_signal: to this (main) thread; the sleeps let Python run the handler there
    assert not stop.now(1)
    signal.raise_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert stop.now(1) and stop.received == "SIGTERM"
    try:
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        print("aborted")
assert signal.getsignal(signal.SIGINT) is before
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0 and proc.stdout.strip() == "aborted", proc.stderr
    assert "SIGTERM: finishing this step, then saving a checkpoint (Ctrl-C again to abort)" in proc.stderr


def test_a_full_disk_stops_the_run_at_once_with_one_error_and_no_partial_checkpoint(tmp_path):
    """A file size limit makes every checkpoint write fail as a full disk would (EFBIG instead of ENOSPC)."""

    # a write past the limit then fails (EFBIG) instead of killing the process (SIGXFSZ)
    small_files = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                   "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); sys.argv[0] = 'jaxcls.train'; "
                   "runpy.run_module('jaxcls.train', run_name='__main__')")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ["XLA_FLAGS"])
    proc = subprocess.run([sys.executable, "-c", small_files, "--config", "tests/tiny.py", "--workdir", str(tmp_path),
                           "--config.ckpt_every=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line.split("\r")[-1] for line in proc.stderr.splitlines()]
    lines = [line for line in lines if line.strip() and not BAR.search(line)]
    errors = [line for line in lines if line.startswith("error")]  # (the compilation cache warns it cannot write)
    assert proc.returncode == 1 and len(errors) == 1, "\n".join(lines)
    assert re.match(rf"error: saving checkpoint {tmp_path}/checkpoints/2 failed: .*File too large", errors[0])
    assert "Traceback (most recent call last)" not in proc.stderr and len(lines) < 15, "\n".join(lines)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert max(json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()) <= 4


def test_bad_records_stop_the_run_naming_the_file_or_are_skipped_listed_and_counted(tmp_path):
    """A folder of the tiny run's 64 classes, one image each (an epoch per 2 steps), one of them a truncated PNG."""
    from PIL import Image

    from jaxcls.errors import DataError
    from jaxcls.data.sources import ProceduralGlyphs

    glyphs = ProceduralGlyphs(num_classes=64, images_per_class=1, size=16, strokes=4)
    for k in range(64):
        (tmp_path / "data" / f"c{k:02d}").mkdir(parents=True)
        Image.fromarray(glyphs.image(k, 0)).save(tmp_path / "data" / f"c{k:02d}" / "0.png")
    broken = tmp_path / "data" / "c17" / "0.png"
    broken.write_bytes(broken.read_bytes()[:-30])
    c = tiny_config(total_steps=2, warmup_steps=1)
    c.data.kind, c.data.root = "folder", str(tmp_path / "data")
    with pytest.raises(DataError, match=rf"{broken}: cannot decode image"):
        train(c, tmp_path / "strict", progress=False)
    c.data.bad_records = "skip"
    train(c, tmp_path / "skipping", progress=False)
    # listed each time it is decoded (the pipeline reads ahead, here into later epochs); counted when trained past
    listed = (tmp_path / "skipping/bad_records.txt").read_text().splitlines()
    assert listed and {line.split(": ")[0] for line in listed} == {str(broken)}
    rows = [json.loads(line) for line in (tmp_path / "skipping/metrics.jsonl").read_text().splitlines()]
    assert [r["bad_records"] for r in rows] == [0, 1] or [r["bad_records"] for r in rows] == [1, 1]
