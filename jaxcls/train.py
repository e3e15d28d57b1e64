"""The trainer: ``python -m jaxcls.train [--config configs/<name>.py] [--workdir runs/x] [--config.key=value]``.

With no arguments it trains a small IResNet on a procedural many-identity image set (no download) and
verifies on held-out identities. Writes to the workdir: ``config.json`` (the resolved config),
``metrics.jsonl``, TensorBoard events, ``checkpoints/`` (orbax), ``lock`` while it runs.

A workdir with checkpoints resumes from the latest, strictly: the config may differ from the saved one only
in ``config.RESUMABLE_KEYS`` (where and how it runs), and every array must match its checkpoint (the FC rows
alone are re-padded for another mesh). ``--init_from WORKDIR[:STEP]`` starts a new run from another run's
backbone (``--init_fc``: and its FC weight). SIGTERM or Ctrl-C checkpoint and exit with status 75; a run
whose steps stay non-finite stops; a failed checkpoint save stops the run at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
from absl import flags

from jaxcls import distributed
from jaxcls.checkpoint import CheckpointError, RunCheckpoints, remove_unfinished_saves, run_config
from jaxcls.config import check_batchnorm_rows, define_config_flag, from_json, resume_differences, validate
from jaxcls.data.pipeline import device_batch
from jaxcls.eval.evaluator import Evaluator
from jaxcls.interrupts import Preempted, StopRequests
from jaxcls.losses import validate_labels
from jaxcls.mesh import batch_sharding
from jaxcls.plan import gpu_target
from jaxcls.plan.memory import apply_mem_fraction, check_fits, step_memory
from jaxcls.precision import all_finite
from jaxcls.reporting import MetricsWriter, Progress, configure_logging, log, run_cli
from jaxcls.run import build
from jaxcls.workdir import WorkdirLock


class Diverged(RuntimeError):
    """Training cannot go on: the steps stay non-finite, or the state to be saved is."""


def train(config, workdir: str | os.PathLike, devices=None, progress: bool = True, stop_after: int | None = None,
          init_from: str | None = None, init_fc: bool = False):
    """Train (resuming from the workdir's latest checkpoint if any); returns ``(state, last logged metrics)``.

    ``stop_after`` ends the run early at that step (after checkpointing it), as an interruption would.
    ``init_from`` ``"WORKDIR[:STEP]"``: a new run starts from that run's backbone (and FC weight if ``init_fc``).
    """
    workdir = Path(workdir).absolute()  # orbax writes only to absolute paths
    devices = jax.devices() if devices is None else devices
    validate(config, len(devices))  # the config, the lock and a resume's config are refused before the data opens
    check_batchnorm_rows(config, len(devices))
    lock = WorkdirLock(workdir, "jaxcls.train")
    if jax.process_index() == 0:
        taken_over = lock.acquire()
        if taken_over:
            log.warning("%s", taken_over)
        if removed := remove_unfinished_saves(workdir / "checkpoints"):
            log.warning("removed %d unfinished checkpoint save(s) of an earlier process: %s", len(removed),
                        ", ".join(removed))
    try:
        checkpoints = RunCheckpoints(workdir / "checkpoints", config.keep_checkpoints)
        resuming = check_resumable(config, workdir, checkpoints)
        run = build(config, devices)  # opens the training data (a headerless .rec: every record's label read), which
        with StopRequests() as stop:  # a Ctrl-C still interrupts
            stop.starting_after(checkpoints.latest_step() or 0)
            return _train(run, workdir, checkpoints, stop, resuming, progress, stop_after, init_from, init_fc)
    finally:
        if jax.process_index() == 0:
            lock.release()


def _train(run, workdir: Path, checkpoints: RunCheckpoints, stop: StopRequests, resuming: bool, progress: bool,
           stop_after, init_from, init_fc):
    config = run.config
    end = config.total_steps if stop_after is None else min(stop_after, config.total_steps)
    if resuming and checkpoints.latest_step() >= end:  # nothing to train: no compile, no new rows
        log.info("%s is at step %d of %d already: nothing to train", workdir, checkpoints.latest_step(),
                 config.total_steps)
        return checkpoints.restore(run.abstract_state)[0], {}
    if init_from and not resuming:
        check_init_from(run, init_from, init_fc)
    evaluate = Evaluator(run)  # its sets read (or refused) before the compile
    step_fn = compile_fitting_step(run)
    state, batches = start(run, workdir, checkpoints, resuming, init_from, init_fc)
    start_step = int(state["step"])
    distributed.barrier("train step compiled")  # every process starts stepping together
    writer, sharding = MetricsWriter(workdir, resumed_step=start_step), batch_sharding(run.mesh)
    bar = Progress(config.total_steps, start_step, enabled=progress and jax.process_index() == 0)
    bad, last, stopped = BadSteps(config.max_bad_steps, checkpoints), {}, False
    tick, row_step = time.perf_counter(), start_step  # when and at which step the previous row was written
    try:
        for step in range(start_step + 1, end + 1):
            images, labels = next(batches)
            validate_labels(labels, config.num_classes)  # host-side: a bad label stops before any device work
            state, metrics = step_fn(state, *device_batch((images, labels), sharding))
            bad.observe(bar.dispatched(metrics))
            checkpoints.check()  # a save that failed in the background stops the run now
            evaluating = step % config.eval_every == 0 or step == config.total_steps
            if evaluating or step % config.log_every == 0:  # an eval step writes a row whatever the log cadence
                host_metrics = jax.device_get(metrics)  # BadSteps has seen the steps before this one
                last = logged_metrics(host_metrics, step, row_step, config, time.perf_counter() - tick,
                                      bad.total + (not host_metrics["finite"]), bad_records(config, batches))
                if evaluating:
                    last.update(evaluate(state))
                writer.write(step, last)
                bar.show({k: v for k, v in last.items() if "/" not in k or k.endswith("accuracy")})
                tick, row_step = time.perf_counter(), step
            stopped = stop.now(step)
            if step % config.ckpt_every == 0 or step == end or stopped:
                save(checkpoints, step, state, batches.get_state())
            if stopped:
                break
        bad.observe(bar.close())
    finally:  # a good save in flight completes whatever stopped the loop
        bar.close()
        writer.close()
        checkpoints.close()
    if stopped and step < end:  # at the last step the run (or its stop_after) is complete: nothing to resume
        raise Preempted(f"stopped by {stop.received} after step {step}; checkpoint saved in "
                        f"{checkpoints.directory / str(step)}: run the same command to resume")
    return state, last


def compile_fitting_step(run):
    """The train step compiled for the run's abstract state, before any state exists, so that a step too big for
    the devices' memory stops the run here (``memory.DoesNotFit``, with the plan) rather than in an out-of-memory
    error later; logs the step's share of the device memory where the backend reports one."""
    step_fn = run.compile_step(run.abstract_state)
    device = jax.local_devices()[0]
    target = gpu_target.target_of(device.device_kind) or f"<a GPU target like {device.device_kind}>"
    use = check_fits(step_memory(run, step_fn), jax.local_devices(),
                     advice=f"; python -m jaxcls.plan --config <this config> --target {target} --devices "
                            f"{run.mesh.size} plans it for this GPU")
    if use:
        log.info("%s", use)
    return step_fn


def check_resumable(config, workdir: Path, checkpoints: RunCheckpoints) -> bool:
    """Whether the workdir holds checkpoints to resume; refused (``CheckpointError``) if their ``config.json`` is
    missing or differs from ``config`` in a key outside ``RESUMABLE_KEYS``. Cheap: runs before the run is built."""
    if checkpoints.latest_step() is None:
        return False
    saved_config = workdir / "config.json"
    if not saved_config.exists():
        raise CheckpointError(f"{workdir} has checkpoints but no config.json to check this config against")
    differences = resume_differences(from_json(saved_config.read_text()), config)
    if differences:
        raise CheckpointError(f"{workdir} holds a run with another config ({'; '.join(differences)}): resume it "
                              f"with its own config, use a new workdir, or fine-tune with --init_from {workdir}")
    return True


def start(run, workdir: Path, checkpoints: RunCheckpoints, resuming: bool, init_from: str | None, init_fc: bool):
    """``(state, batches)`` to train from: the workdir's latest checkpoint if ``resuming`` (``check_resumable``;
    refused if any array differs), else a fresh state, from ``init_from`` if given. Writes ``config.json``
    (process 0) once the run has been validated."""
    saved_config = workdir / "config.json"
    # each host lists the bad records of its own rows, in a file of its own
    log_file = "bad_records.txt" if jax.process_count() == 1 else f"bad_records.{jax.process_index()}.txt"
    batches = run.batches(bad_records_log=workdir / log_file)
    if resuming:
        state, position = checkpoints.restore(run.abstract_state)
        batches.set_state(position)
    else:
        state = run.init_state()
        if init_from:
            state = initialized_from(run, state, init_from, init_fc)
    distributed.barrier("config.json read")  # by every process, before process 0 replaces it
    if jax.process_index() == 0:
        saved_config.with_suffix(".tmp").write_text(run.config.to_json_best_effort(indent=2))
        saved_config.with_suffix(".tmp").replace(saved_config)
    where = f"resumed from step {int(state['step'])} in {workdir}" if resuming else f"workdir {workdir}"
    for line in run.summary() + [where]:
        log.info(line)
    return state, batches


def check_init_from(run, source: str, with_fc: bool) -> None:
    """Cheap checks of ``--init_from WORKDIR[:STEP]`` (and ``--init_fc``), before anything is compiled: a run's
    checkpoint there (of ``STEP`` if given) and, for the FC, this run's class count (``CheckpointError``)."""
    directory, _, step = source.partition(":")
    if step and not step.isdigit():
        raise ValueError(f"--init_from {source}: expected WORKDIR or WORKDIR:STEP with a step number")
    if not (Path(directory) / "checkpoints").is_dir():
        raise CheckpointError(f"--init_from {source}: {Path(directory).absolute()} holds no run's checkpoints")
    other = RunCheckpoints(Path(directory) / "checkpoints", keep=1, read_only=True)
    steps = other.manager.all_steps()
    other.close()
    if not steps or (step and int(step) not in steps):
        held = f"only steps {sorted(steps)}" if steps else "no checkpoint"
        raise CheckpointError(f"--init_from {source}: {Path(directory).absolute()} holds {held}")
    if with_fc:
        classes = run_config(directory).num_classes
        if classes != run.config.num_classes:
            raise CheckpointError(f"--init_fc: {directory} has an FC of {classes} classes, this run "
                                  f"{run.config.num_classes}")


def initialized_from(run, state: dict, source: str, with_fc: bool) -> dict:
    """``state`` with the backbone (and the FC weight if ``with_fc``) of run ``source`` = ``WORKDIR[:STEP]``, which
    ``check_init_from`` has checked."""
    directory, _, step = source.partition(":")
    other = RunCheckpoints(Path(directory) / "checkpoints", keep=1, read_only=True)
    parts = ("params", "stats") + (("weight",) if with_fc else ())
    restored, _ = other.restore(run.abstract_state, int(step) if step else None, parts=parts)
    other.close()
    log.info("initialized %s from %s", " and ".join(parts), source)
    return {**state, **restored}


class BadSteps:
    """Counts the steps the train step skipped (non-finite loss, gradient or update); after ``limit`` in a row the
    run stops (``Diverged``) naming the step, lr, gradient norm and the last good checkpoint."""

    def __init__(self, limit: int, checkpoints: RunCheckpoints):
        self.limit, self.checkpoints, self.total, self.in_a_row = limit, checkpoints, 0, 0

    def observe(self, completed: list[tuple[int, dict]]) -> None:
        for step, metrics in completed:
            if metrics["finite"]:
                self.in_a_row = 0
                continue
            self.total, self.in_a_row = self.total + 1, self.in_a_row + 1
            if self.in_a_row >= self.limit:
                lr, norm, loss = (float(metrics[k]) for k in ("lr", "grad_norm", "loss"))
                raise Diverged(f"stopped at step {step}: {self.in_a_row} steps in a row had a non-finite loss, "
                               f"gradient or update (lr {lr:.4g}, grad norm {norm:.4g}, loss {loss:.4g}) and were "
                               f"skipped; {last_good(self.checkpoints)}")


def last_good(checkpoints: RunCheckpoints) -> str:
    step = checkpoints.latest_step()
    return "no checkpoint yet" if step is None else f"last good checkpoint: {checkpoints.directory / str(step)}"


def save(checkpoints: RunCheckpoints, step: int, state: dict, data_position: dict) -> None:
    """Start saving ``state`` unless any of it is non-finite (``Diverged``: nothing non-finite is ever saved)."""
    bad = [k for k, finite in jax.device_get(_finite_parts(state)).items() if not finite]
    if bad:
        raise Diverged(f"the state after step {step} holds non-finite values (in {', '.join(sorted(bad))}) and was "
                       f"not saved; {last_good(checkpoints)}")
    checkpoints.save(step, state, data_position)


_finite_parts = jax.jit(lambda state: {k: all_finite(v) for k, v in state.items()})


def bad_records(config, batches) -> int | None:
    """The records skipped in the batches trained since the process started, over every host (each decodes its own
    rows); ``None`` unless ``data.bad_records`` is ``skip``. Every process calls it at the same steps."""
    return distributed.summed_over_processes(batches.bad_records) if config.data.bad_records == "skip" else None


def logged_metrics(metrics: dict, step: int, row_step: int, config, seconds: float, skipped: int,
                   bad_records: int | None) -> dict:
    """The row of ``metrics.jsonl`` for ``step``, ``seconds`` after the previous row (at ``row_step``), ``skipped``
    the steps skipped up to this one (since this process started the run), ``bad_records`` the skipped records
    (``None`` where records are not skipped: no column); warns on a bad step."""
    row = {k: float(metrics[k]) for k in ("loss", "lr", "grad_norm", "loss_scale")}
    row.update(img_per_s=(step - row_step) * config.batch_size / seconds, skipped_steps=skipped)
    if bad_records is not None:  # counted where they are skipped
        row["bad_records"] = bad_records
    if not metrics["finite"]:
        log.warning("step %d: non-finite loss, gradient or update; update skipped%s", step,
                    ", loss scale halved" if config.precision == "float16" else "")
    return row


def main(argv):
    del argv  # run_cli refuses positional arguments
    configure_logging(verbose=flags.FLAGS["verbosity"].present)
    f = flags.FLAGS
    apply_mem_fraction(f.config)  # before JAX starts a GPU backend
    distributed.initialize_from_flags()
    _, final = train(f.config, f.workdir, stop_after=f.stop_after, init_from=f.init_from, init_fc=f.init_fc)
    if not final:  # the run was at its end already
        return
    accuracies = ", ".join(f"{k.split('/')[1]} {v:.2%} ± {final[k + '_std']:.2%}"
                           for k, v in final.items() if k.endswith("/accuracy"))
    log.info("done: loss %.4g%s", final.get("loss", float("nan")), f", verification {accuracies}" if accuracies else "")


def define_flags():
    define_config_flag()
    flags.DEFINE_string("workdir", "runs/default", "where checkpoints, metrics and the config go")
    flags.DEFINE_integer("stop_after", None, "end after this step (checkpointed), e.g. within a time-limited job")
    flags.DEFINE_string("init_from", None, "WORKDIR[:STEP]: start a new run from that run's backbone")
    flags.DEFINE_bool("init_fc", False, "with --init_from: take its FC weight too (same num_classes)")
    distributed.define_flags()


if __name__ == "__main__":
    define_flags()
    run_cli(main)
