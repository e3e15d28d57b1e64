"""What a run reports: the console (a progress bar, jaxcls's messages, warnings), ``metrics.jsonl`` and TensorBoard.

Quiet by default: other libraries (orbax, absl) log at WARNING unless ``--verbosity`` asks for more.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
from pathlib import Path

import jax
from absl import app, flags
from absl import logging as absl_logging
from tqdm import tqdm

from jaxcls.errors import DataError

log = logging.getLogger("jaxcls")


class _BarSafeHandler(logging.Handler):
    """Writes records above the progress bar instead of through it, prefixed ``[process i] LEVEL`` when the
    run has several processes (asked at each record: logging may be configured before jax.distributed)."""

    def emit(self, record):
        message = self.format(record)
        if jax.process_count() > 1:
            message = f"[process {jax.process_index()}] {record.levelname} {message}"
        tqdm.write(message, file=sys.stderr)


def _not_from_orbax(record) -> bool:
    """Orbax logs each failure of a background save several times with its traceback (and asyncio once more
    per failed write); jaxcls raises it once (``checkpoint.CheckpointError``), so those records are dropped
    unless ``--verbosity`` asks for them."""
    return not (record.levelno >= logging.ERROR and ("orbax" in record.pathname or "orbax" in record.getMessage()
                                                     or "orbax" in str(record.exc_info)))


def _quiet_closed_loops(hook):
    """``sys.unraisablehook`` silent for the callbacks tensorstore still makes into the event loop of an orbax save
    that has already failed (``RuntimeError: Event loop is closed``, once per write in flight)."""
    def unraisablehook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            hook(unraisable)
    unraisablehook.quiet = True
    return unraisablehook


def configure_logging(verbose: bool = False) -> None:
    """jaxcls messages (INFO and up) on stderr; absl and the libraries logging through it (orbax, jax's
    distributed setup) at WARNING unless ``verbose``. Call it first: it touches no device."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).removeFilter(_not_from_orbax)
        if not verbose:
            logging.getLogger(name).addFilter(_not_from_orbax)
    if not verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        if not getattr(sys.unraisablehook, "quiet", False):
            sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)
    log.handlers[:] = [_BarSafeHandler()]
    log.setLevel(logging.INFO)
    log.propagate = False


def one_line(error: BaseException) -> str:
    """An exception as one line: its message's first line, prefixed by its type unless that is a ``ValueError``,
    ``OSError`` or ``RuntimeError`` (whose messages say what went wrong)."""
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if isinstance(error, (ValueError, OSError, RuntimeError)) and message:
        return message + (" …" if len(lines) > 1 else "")
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def run_cli(main) -> None:
    """``absl.app.run(main)`` for jaxcls's command-line programs: a bad flag or config key, a positional argument,
    and any exception from ``main``, end the program with one line on stderr (exit status 2 for the command line, 1
    for an error, an exception's own ``exit_code`` for an expected end); ``--verbosity=…`` shows the traceback.
    A Ctrl-C that ``main`` lets through exits with 130."""
    from jaxcls.config import check_config_flags

    def parse(argv):
        try:
            check_config_flags(argv)
            rest = flags.FLAGS(argv)
            if len(rest) > 1:  # no program takes positional arguments: a forgotten flag name is an error
                raise ValueError(f"unexpected arguments {rest[1:]} (every input is a --flag)")
            return rest
        except Exception as e:
            if any(a.startswith(("--verbosity", "-v")) for a in argv[1:]):
                raise
            print(f"error: {one_line(e)}", file=sys.stderr)
            sys.exit(2)

    def guarded(argv):
        try:
            return main(argv)
        except KeyboardInterrupt:
            print("aborted", file=sys.stderr)
            sys.exit(130)
        except Exception as e:
            if flags.FLAGS["verbosity"].present:
                raise
            if hasattr(e, "exit_code"):  # an expected end, e.g. a preempted run that saved its checkpoint
                log.warning("%s", e)
                sys.exit(e.exit_code)
            log.error("error: %s (--verbosity=1 for the traceback)", one_line(e))
            for line in getattr(e, "details", ()):  # e.g. the memory plan of a step too big for the device
                log.error("%s", line)
            # no interpreter shutdown: background threads of a failed run (orbax writers still in flight)
            # would print tracebacks into the closed event loop after the one line
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    app.run(guarded, flags_parser=parse)


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

    def dispatched(self, metrics) -> list[tuple[int, dict]]:
        """Record a dispatched step (its metrics, still on the device); advance past the finished ones and return
        them as ``(step, metrics on the host)``."""
        self.pending.append(metrics)
        return [self._complete() for _ in range(len(self.pending) - 1)]

    def _complete(self) -> tuple[int, dict]:
        metrics = jax.device_get(self.pending.popleft())
        self.completed += 1
        self.bar.update(1)
        return self.completed, metrics

    def show(self, values: dict) -> None:
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()})

    def close(self) -> list[tuple[int, dict]]:
        """Wait for the steps in flight; returns them as ``dispatched`` does (nothing the second time)."""
        done = [self._complete() for _ in range(len(self.pending))]
        self.bar.close()
        return done


class MetricsWriter:
    """``metrics.jsonl`` plus TensorBoard scalars (when tensorboardX is installed), process 0 only.

    ``resumed_step``: rows past it (written by a run that went on after its last checkpoint) are dropped,
    so the file holds every step once; so is a torn last row (a process stopped while writing it), with a warning.
    A row before the last that is not JSON is a ``DataError`` naming its line.
    """

    def __init__(self, workdir: Path, resumed_step: int = 0):
        self.active = jax.process_index() == 0
        self.file = self.tb = None
        if not self.active:
            return
        path = workdir / "metrics.jsonl"
        if path.exists():
            rows = [line for line, row in read_rows(path) if row["step"] <= resumed_step]
            kept = path.with_name(path.name + ".tmp")  # whole or not at all, whatever stops this process
            kept.write_text("".join(row + "\n" for row in rows))
            os.replace(kept, path)
        self.file = open(path, "a")
        # TensorBoard drops the earlier files' events from the resumed step on, as the rows above are dropped
        self.tb = tensorboard_writer(workdir / "tensorboard", purge_step=resumed_step + 1 if resumed_step else None)

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


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """``(line, row)`` of each JSON row of ``path``; a torn last line is left out with a warning."""
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((line, json.loads(line)))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise DataError(f"{path}:{number}: not a JSON row ({e}): {line[:80]!r}") from None
            log.warning("%s:%d: a torn last row (its process stopped while writing it) is dropped: %r", path,
                        number, line[:80])
    return rows


def tensorboard_writer(logdir: Path, purge_step: int | None = None):
    """tensorboardX's ``SummaryWriter`` on ``logdir``, or None where tensorboardX is not installed.

    tensorboardX imports torch when it is installed, to accept torch tensors (~2.5 s of a run's start; jaxcls writes
    floats): unless torch is imported already, it is hidden from that import.
    """
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX takes as "no torch"
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter(str(logdir), purge_step=purge_step)
