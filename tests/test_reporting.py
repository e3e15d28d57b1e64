"""Console, progress bar and metrics files of a run."""

import json
import logging

import jax
import jax.numpy as jnp
from absl import logging as absl_logging

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
    assert any((tmp_path / "tensorboard").iterdir())


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
