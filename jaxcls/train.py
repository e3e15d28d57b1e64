"""The trainer: ``python -m jaxcls.train [--config configs/<name>.py] [--workdir runs/x] [--config.key=value]``.

With no arguments it trains a small IResNet on a procedural many-identity image set (no download) and
verifies on held-out identities. Writes to the workdir: ``config.json`` (the resolved config),
``metrics.jsonl``, TensorBoard events, ``checkpoints/`` (orbax; resumed automatically).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
from absl import app, flags
from ml_collections import config_flags

from jaxcls import distributed
from jaxcls.checkpoint import RunCheckpoints, check_num_classes
from jaxcls.data.pipeline import device_batch
from jaxcls.eval.evaluator import Evaluator
from jaxcls.losses import validate_labels
from jaxcls.mesh import batch_sharding
from jaxcls.reporting import MetricsWriter, Progress, configure_logging, log
from jaxcls.run import build


def train(config, workdir: str | os.PathLike, devices=None, progress: bool = True, stop_after: int | None = None):
    """Train (resuming from the workdir's latest checkpoint if any); returns ``(state, last logged metrics)``.

    ``stop_after`` ends the run early at that step (after checkpointing it), as an interruption would.
    """
    workdir = Path(workdir).absolute()  # orbax writes only to absolute paths
    workdir.mkdir(parents=True, exist_ok=True)
    run = build(config, devices)
    checkpoints = RunCheckpoints(workdir / "checkpoints", config.keep_checkpoints)
    resuming = checkpoints.latest_step() is not None
    saved_config = workdir / "config.json"
    if resuming and saved_config.exists():
        # restores pad or truncate FC rows to the new mesh, so a changed class count must be caught here
        check_num_classes(json.loads(saved_config.read_text())["num_classes"], config.num_classes)
    distributed.barrier("config.json read")  # by every process, before process 0 replaces it
    if jax.process_index() == 0:
        saved_config.with_suffix(".tmp").write_text(config.to_json_best_effort(indent=2))
        saved_config.with_suffix(".tmp").replace(saved_config)
    batches = run.batches()
    if resuming:
        state, position = checkpoints.restore(run.abstract_state)
        batches.set_state(position)
    else:
        state = run.init_state()
    start = int(state["step"])
    for line in run.summary() + ([f"resumed from step {start} in {workdir}"] if resuming else [f"workdir {workdir}"]):
        log.info(line)
    step_fn, evaluate = run.compile_step(state), Evaluator(run)  # compiled before the barrier
    distributed.barrier("train step compiled")  # every process starts stepping together
    writer, sharding = MetricsWriter(workdir, resumed_step=start), batch_sharding(run.mesh)
    end = config.total_steps if stop_after is None else min(stop_after, config.total_steps)
    bar = Progress(config.total_steps, start, enabled=progress and jax.process_index() == 0)
    last, tick = {}, time.perf_counter()
    for step in range(start + 1, end + 1):
        images, labels = next(batches)
        validate_labels(labels, config.num_classes)  # host-side: a bad label stops before any device work
        state, metrics = step_fn(state, *device_batch((images, labels), sharding))
        bar.dispatched(metrics)
        if step % config.log_every == 0 or step == config.total_steps:
            last = logged_metrics(jax.device_get(metrics), step, config, time.perf_counter() - tick)
            if step % config.eval_every == 0 or step == config.total_steps:
                last.update(evaluate(state))
            writer.write(step, last)
            bar.show({k: v for k, v in last.items() if "/" not in k or k.endswith("accuracy")})
            tick = time.perf_counter()
        if step % config.ckpt_every == 0 or step == end:
            checkpoints.save(step, state, batches.get_state())
    bar.close()
    checkpoints.close()
    writer.close()
    return state, last


def logged_metrics(metrics: dict, step: int, config, seconds: float) -> dict:
    """The row of ``metrics.jsonl`` for a log step (``seconds`` since the previous one); warns on a bad step."""
    steps = config.log_every if step % config.log_every == 0 else step % config.log_every
    row = {k: float(metrics[k]) for k in ("loss", "lr", "grad_norm", "loss_scale")}
    row["img_per_s"] = steps * config.batch_size / seconds
    if not metrics["finite"]:
        log.warning("step %d: non-finite loss or gradients%s", step,
                    "; update skipped, loss scale halved" if config.precision == "float16" else "")
    return row


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    configure_logging(verbose=flags.FLAGS["verbosity"].present)
    distributed.initialize_from_flags()
    _, final = train(flags.FLAGS.config, flags.FLAGS.workdir, stop_after=flags.FLAGS.stop_after)
    accuracies = ", ".join(f"{k.split('/')[1]} {v:.2%} ± {final[k + '_std']:.2%}"
                           for k, v in final.items() if k.endswith("/accuracy"))
    log.info("done: loss %.4g%s", final.get("loss", float("nan")), f", verification {accuracies}" if accuracies else "")


def define_flags():
    default = os.path.join(os.path.dirname(__file__), "config.py")
    config_flags.DEFINE_config_file("config", default, "a configs/*.py file; default: the built-in procedural run")
    flags.DEFINE_string("workdir", "runs/default", "where checkpoints, metrics and the config go")
    flags.DEFINE_integer("stop_after", None, "end after this step (checkpointed), e.g. within a time-limited job")
    distributed.define_flags()


if __name__ == "__main__":
    define_flags()
    app.run(main)
