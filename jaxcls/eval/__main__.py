"""Verification of a trained run: ``python -m jaxcls.eval --workdir runs/x --bin lfw.bin [--bin b.bin]``.

Loads the run's resolved config and its latest (or ``--step``) checkpoint onto the devices here, prints a
table and writes ``<workdir>/eval_<step>.json``. ``--export DIR`` also writes the backbone alone. Over several
processes it launches like the trainer (``--distributed`` and the flags of ``jaxcls.distributed``); process 0
prints and writes.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
from absl import flags

from jaxcls import distributed
from jaxcls.checkpoint import RunCheckpoints
from jaxcls.config import from_json
from jaxcls.eval.evaluator import Evaluator
from jaxcls.export import export_backbone
from jaxcls.reporting import configure_logging, run_cli
from jaxcls.run import build
from jaxcls.workdir import WorkdirLock, WorkdirLocked

flags.DEFINE_string("workdir", None, "the training run's workdir", required=True)
flags.DEFINE_multi_string("bin", [], "verification .bin files (default: the run's own eval sets)")
flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
flags.DEFINE_string("export", None, "also export the backbone to this folder")
distributed.define_flags()
FLAGS = flags.FLAGS


def main(argv):
    configure_logging(verbose=FLAGS["verbosity"].present)
    distributed.initialize_from_flags()
    workdir = Path(FLAGS.workdir).absolute()
    config = from_json((workdir / "config.json").read_text())
    if FLAGS.bin:
        config.eval_bins = tuple(FLAGS.bin)
    run = build(config, with_data=False)
    checkpoints = RunCheckpoints(workdir / "checkpoints", config.keep_checkpoints)
    state, _ = checkpoints.restore(run.abstract_state, FLAGS.step)
    step = int(state["step"])
    results = Evaluator(run)(state)
    if jax.process_index() == 0:
        with holding(workdir):
            report(step, results, workdir / f"eval_{step}.json")
    if FLAGS.export:
        export_backbone(config, state, FLAGS.export)  # every process writes its part
        if jax.process_index() == 0:
            print(f"exported the backbone to {FLAGS.export}")
    checkpoints.close()


@contextlib.contextmanager
def holding(workdir: Path):
    """The workdir's lock while the results are written, so no trainer starts meanwhile; a running trainer
    keeps its lock (the results are a file of their own)."""
    lock = WorkdirLock(workdir, "jaxcls.eval")
    try:
        lock.acquire()
    except WorkdirLocked:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def report(step: int, results: dict, out: Path) -> None:
    """Print the table of ``results`` and write them to ``out``."""
    names = sorted({k.split("/")[1] for k in results})
    print(f"step {step}")
    print(f"{'set':<16} {'accuracy':>10} {'std':>8} {'threshold':>10} {'xnorm':>8}")
    for n in names:
        r = {k.split("/")[2]: v for k, v in results.items() if k.split("/")[1] == n}
        print(f"{n:<16} {r['accuracy']:>10.4f} {r['accuracy_std']:>8.4f} {r['best_threshold']:>10.3f} "
              f"{r['xnorm']:>8.2f}")
    out.write_text(json.dumps({"step": step, **results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
