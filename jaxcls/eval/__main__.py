"""Verification of a trained run: ``python -m jaxcls.eval --workdir runs/x --bin lfw.bin [--bin b.bin]``.

Loads the run's resolved config and its latest (or ``--step``) checkpoint onto the devices here, prints a
table (accuracy as insightface, AUC, TAR at FAR) and writes ``<workdir>/eval_<step>.json``; ``--roc`` also draws
the sets' ROC curves to ``<workdir>/roc_<step>.png`` (matplotlib). With several ``--workdir`` (e.g. one recipe
trained with several seeds) each run is evaluated in turn, then the mean ± sample std over the runs is printed
for every set they all have. IJB-B/C: ``python -m jaxcls.eval.ijb``. Over several
processes it launches like the trainer (``--distributed`` and the flags of ``jaxcls.distributed``); process 0
prints and writes.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import numpy as np
from absl import flags

from jaxcls import distributed
from jaxcls.checkpoint import RunCheckpoints, run_config
from jaxcls.eval.evaluator import Evaluator
from jaxcls.eval.roc import far_key, has_both_kinds, plot_roc, roc_curve, unmeasurable
from jaxcls.eval.verification import FARS, l2_normalize, pair_cosines
from jaxcls.extras import optional_import
from jaxcls.reporting import configure_logging, run_cli
from jaxcls.run import build
from jaxcls.workdir import WorkdirLock, WorkdirLocked

FLAGS = flags.FLAGS


def main(argv):
    configure_logging(verbose=FLAGS["verbosity"].present)
    if FLAGS.roc:
        optional_import("matplotlib", "plot")  # before the evaluation, not after
    distributed.initialize_from_flags()
    results = [evaluate(Path(workdir).absolute()) for workdir in FLAGS.workdir]
    if jax.process_index() == 0 and len(results) > 1:
        report_over_runs(results)


def evaluate(workdir: Path) -> dict:
    """Evaluate ``workdir``'s checkpoint (``--step`` or the latest) on ``--bin`` or its own sets; process 0 prints
    and writes the results; returns them (``val/<set>/<metric>`` keys)."""
    config = run_config(workdir)
    if FLAGS.bin:
        config.eval_bins = tuple(str(Path(b).absolute()) for b in FLAGS.bin)  # from here, not the run's data root
    # the training batch and mesh play no part here: evaluated on whatever devices this machine has, all data parallel
    config.mesh_data, config.batch_size = 1, jax.device_count() * config.accum_steps
    # nor does the FC's optimizer state, left on disk: a state jaxcls no longer trains with (adamw's in bfloat16)
    config.fc_state_dtype = "float32"
    run = build(config, with_data=False)
    evaluator = Evaluator(run)  # its sets read (or refused) before the checkpoint is
    checkpoints = RunCheckpoints(workdir / "checkpoints", config.keep_checkpoints)
    # the backbone alone: the FC and both optimizers' states (at 29M classes ~118 GB in float32) stay on disk
    state, _ = checkpoints.restore(run.abstract_state, FLAGS.step, parts=("step", "params", "stats"))
    step = int(state["step"])
    embeddings = evaluator.embeddings(state)
    results = evaluator.metrics(embeddings)
    if jax.process_index() == 0:
        with holding(workdir):
            if len(FLAGS.workdir) > 1:
                print(workdir)
            report(step, results, workdir / f"eval_{step}.json")
            if FLAGS.roc:
                curves = {name: roc_curve(issame, pair_cosines(l2_normalize(views.sum(0))))[:2]
                          for name, (views, issame) in embeddings.items() if has_both_kinds(issame)}
                plot_roc(curves, workdir / f"roc_{step}.png", f"{workdir.name}, step {step}")
                print(f"wrote {workdir / f'roc_{step}.png'}")
    checkpoints.close()
    return results


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
    tars = [far_key(far) for far in FARS]
    print(f"{'set':<16} {'accuracy':>10} {'std':>8} {'threshold':>10} {'xnorm':>8} {'auc':>8} "
          + " ".join(f"{'TAR@' + k.split('=')[1]:>12}" for k in tars))
    notes = []
    for n in names:
        r = {k.split("/")[2]: v for k, v in results.items() if k.split("/")[1] == n}
        cells = " ".join(f"{r[k]:>12.4f}" if k in r else f"{'-':>12}" for k in tars)
        print(f"{n:<16} {r['accuracy']:>10.4f} {r['accuracy_std']:>8.4f} {r['best_threshold']:>10.3f} "
              f"{r['xnorm']:>8.2f} {r.get('auc', float('nan')):>8.4f} {cells}")
        note = "impostor_pairs" in r and unmeasurable(FARS, r["impostor_pairs"])
        if note:
            notes.append(f"{n}: {note}")
    for note in notes:
        print(note)
    out.write_text(json.dumps({"step": step, **results}, indent=1))
    print(f"wrote {out}")


def over_runs(results: list[dict]) -> tuple[dict, list[str]]:
    """``({key: (mean, sample std, runs)}, keys left out)`` over several runs' results: the keys every run has
    (a set one run lacks is left out, named); the std is 0 for a single run."""
    common = set.intersection(*(set(r) for r in results))
    summary = {}
    for key in sorted(common):
        values = np.array([r[key] for r in results], np.float64)
        summary[key] = (values.mean(), values.std(ddof=1) if len(values) > 1 else 0.0, len(values))
    return summary, sorted(set.union(*(set(r) for r in results)) - common)


def report_over_runs(results: list[dict]) -> None:
    """Print the mean ± sample std over the runs of accuracy, AUC and TAR at each FAR, a line per set."""
    summary, left_out = over_runs(results)
    metrics = ["accuracy", "auc", *(far_key(far) for far in FARS)]
    print(f"over {len(results)} runs: mean ± sample std")
    print(f"{'set':<16} " + " ".join(f"{m.replace('tar@far=', 'TAR@'):>17}" for m in metrics))
    for name in sorted({k.split("/")[1] for k in summary}):
        cells = [summary.get(f"val/{name}/{m}") for m in metrics]
        print(f"{name:<16} " + " ".join(f"{c[0]:>8.4f} ± {c[1]:<6.4f}" if c else f"{'-':>17}" for c in cells))
    sets = sorted({k.split("/")[1] for k in left_out})
    if sets:
        print(f"not in every run, left out: {', '.join(sets)}")


def define_flags():
    flags.DEFINE_multi_string("workdir", None, "the training run's workdir; repeat it for the mean ± std over runs",
                              required=True)
    flags.DEFINE_multi_string("bin", [], "verification .bin files (default: the run's own eval sets)")
    flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
    flags.DEFINE_bool("roc", False, "also plot the ROC curves to <workdir>/roc_<step>.png (needs matplotlib)")
    distributed.define_flags()


if __name__ == "__main__":
    define_flags()
    run_cli(main)
