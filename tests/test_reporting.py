"""Console, progress bar and metrics files of a run."""

import json
import logging
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from absl import logging as absl_logging

from conftest import jaxcls_records
from jaxcls.errors import DataError
from jaxcls.reporting import MetricsWriter, Progress, configure_logging, log


def test_metrics_rows_past_the_restored_step_are_dropped(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)})
    writer.close()
    writer = MetricsWriter(tmp_path, resumed_step=3)  # steps 4 and 5 were lost with the process
    writer.write(4, {"loss": 40.0})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # TensorBoard is told to drop an earlier file's steps from 4 on, as the rows above are dropped
    assert purges(tmp_path / "tensorboard") == [4] and ("loss", 4, 40.0) in scalars(tmp_path / "tensorboard")


def test_a_torn_last_row_is_dropped_and_a_bad_row_before_it_is_named(tmp_path, caplog):
    """A process killed while writing leaves a torn last row: every later resume would fail to read the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    with jaxcls_records(caplog):
        MetricsWriter(tmp_path, resumed_step=2).close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n'
    assert "metrics.jsonl:3: a torn last row (its process stopped while writing it) is dropped" in caplog.text
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 3.0}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not a JSON row \(.*\): '\{\"step\": 2, \"lo'$"):
        MetricsWriter(tmp_path, resumed_step=3)


def events(logdir):
    """Every ``Event`` in the TensorBoard event files of ``logdir``, file by file in name (time) order (records: a
    little-endian uint64 length, its CRC, the serialized ``Event``, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(logdir.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            yield Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4


def scalars(logdir):
    """``(tag, step, value)`` of every scalar in ``logdir``'s event files."""
    return [(v.tag, event.step, v.simple_value) for event in events(logdir) for v in event.summary.value]


def purges(logdir):
    """The steps from which a writer told TensorBoard to drop earlier files' events (a session START at a step)."""
    from tensorboardX.proto.event_pb2 import SessionLog

    return [event.step for event in events(logdir)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START]


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch where it is installed (seconds); the writer hides it from that import, and
    ``import torch`` works again after."""
    script = ("import sys; from pathlib import Path; from jaxcls.reporting import MetricsWriter; "
              f"w = MetricsWriter(Path({str(tmp_path)!r})); w.write(1, {{'loss': 2.5, 'lr': 0.5}}); "
              "w.write(2, {'loss': 1.25}); w.close(); print('torch' in sys.modules); "
              "import importlib.util; print(importlib.util.find_spec('torch') is None or bool(__import__('torch')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False", "True"], done.stderr[-2000:]
    assert scalars(tmp_path / "tensorboard") == [("loss", 1, 2.5), ("lr", 1, 0.5), ("loss", 2, 1.25)]


def test_progress_counts_completed_steps_one_behind_the_dispatch():
    bar = Progress(total=5, initial=1, enabled=False)
    step = jax.jit(lambda x: x + 1)
    x = jnp.zeros(())
    for expected in (1, 2, 3):
        x = step(x)
        done = bar.dispatched({"loss": x})
        assert bar.completed == expected and len(bar.pending) == 1  # the newest step may still be running
        assert [(s, float(m["loss"])) for s, m in done] == ([] if expected == 1 else [(expected, expected - 1.0)])
    assert [(s, float(m["loss"])) for s, m in bar.close()] == [(4, 3.0)]
    assert bar.completed == 4 and not bar.pending and bar.close() == []


def test_logging_is_quiet_for_libraries_and_plain_for_jaxcls(capsys):
    configure_logging(verbose=False)
    assert absl_logging.get_verbosity() == absl_logging.WARNING
    assert log.level == logging.INFO and not log.propagate
    log.info("model r18")
    absl_logging.info("an orbax detail")
    assert capsys.readouterr().err == "model r18\n"
    absl_logging.set_verbosity(absl_logging.INFO)  # as --verbosity=0 leaves it
    configure_logging(verbose=True)
    assert absl_logging.get_verbosity() == absl_logging.INFO


@pytest.mark.parametrize("command", [["jaxcls.eval", "--workdir", "runs/x", "lfw.bin"],  # --bin forgotten
                                     ["jaxcls.plan", "--devices", "0"]], ids=lambda c: c[0])
def test_a_command_line_error_is_one_line_and_status_2_before_anything_runs(command, tmp_path):
    """A positional argument (``run_cli`` refuses them for every program: each takes only flags) and a flag out of
    its bounds: ``error: …``, exit 2."""
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("error: "), done.stderr[-2000:]
    assert ("unexpected arguments" in last) == (command[0] != "jaxcls.plan") and not (tmp_path / "runs").exists()

