"""What a run reports: the console (a progress bar, jaxcls's messages, warnings), ``metrics.jsonl`` and TensorBoard.

Quiet by default: other libraries (orbax, absl) log at WARNING unless ``--verbosity`` asks for more.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
from pathlib import Path

import jax
from absl import logging as absl_logging
from tqdm import tqdm

log = logging.getLogger("jaxcls")


class _BarSafeHandler(logging.Handler):
    """Writes records above the progress bar instead of through it, prefixed ``[process i] LEVEL`` when the
    run has several processes (asked at each record: logging may be configured before jax.distributed)."""

    def emit(self, record):
        message = self.format(record)
        if jax.process_count() > 1:
            message = f"[process {jax.process_index()}] {record.levelname} {message}"
        tqdm.write(message, file=sys.stderr)


def configure_logging(verbose: bool = False) -> None:
    """jaxcls messages (INFO and up) on stderr; absl and the libraries logging through it (orbax, jax's
    distributed setup) at WARNING unless ``verbose``. Call it first: it touches no device."""
    if not verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
    log.handlers[:] = [_BarSafeHandler()]
    log.setLevel(logging.INFO)
    log.propagate = False


class Progress:
    """A tqdm bar over *completed* steps.

    Steps are dispatched asynchronously; each step's metrics are waited for once the next step has been
    dispatched, so the device always has work queued while the bar's rate and ETA count finished steps
    (counting dispatches made the bar move in bursts and promise hours for minutes).
    """

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
        self.pending = collections.deque()
        self.completed = initial

    def dispatched(self, metrics) -> None:
        """Record a dispatched step (its metrics, still on the device); advance past the finished ones."""
        self.pending.append(metrics)
        while len(self.pending) > 1:
            self._complete()

    def _complete(self) -> None:
        jax.block_until_ready(self.pending.popleft())
        self.completed += 1
        self.bar.update(1)

    def show(self, values: dict) -> None:
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()})

    def close(self) -> None:
        while self.pending:
            self._complete()
        self.bar.close()


class MetricsWriter:
    """``metrics.jsonl`` plus TensorBoard scalars (when tensorboardX is installed), process 0 only.

    ``resumed_step``: rows past it (written by a run that went on after its last checkpoint) are dropped,
    so the file holds every step once.
    """

    def __init__(self, workdir: Path, resumed_step: int = 0):
        self.active = jax.process_index() == 0
        self.file = self.tb = None
        if not self.active:
            return
        path = workdir / "metrics.jsonl"
        if path.exists():
            rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resumed_step]
            path.write_text("".join(row + "\n" for row in rows))
        self.file = open(path, "a")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(workdir / "tensorboard"))
        except ImportError:
            pass

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": step, **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
