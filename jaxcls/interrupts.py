"""Stop a run cleanly on SIGTERM (a cluster's preemption notice) or Ctrl-C: finish the step, checkpoint, exit.

``StopRequests`` turns the first SIGTERM or SIGINT into a request that the training loop reads after each
step (``stop_now(step)``); a second Ctrl-C aborts at once. With several processes every process must stop
after the same step, so they agree through JAX's preemption sync point: JAX's own SIGTERM notifier (set up by
``jax.distributed.initialize``) informs every process, and a Ctrl-C is passed on to it as a SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

from jaxcls.reporting import log

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: try again (the run resumes from its checkpoint)


class Preempted(Exception):
    """The run stopped on request after checkpointing; the message says where. ``exit_code`` for the CLI."""

    exit_code = PREEMPTED_EXIT_CODE


class StopRequests:
    """``with StopRequests() as stop: … if stop.now(step): …`` — signal handlers installed inside the block
    (main thread only; elsewhere nothing is installed and only a multi-process preemption notice counts)."""

    def __init__(self):
        self.received = None  # name of the first signal
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            # with several processes SIGTERM stays JAX's (its notifier feeds the sync point)
            signals = [signal.SIGINT] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
            self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C
        self.received = signal.Signals(signum).name
        log.warning("%s: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", self.received)
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier, which tells every process

    def starting_after(self, step: int) -> None:
        """Tell the sync point the step the run continues from, as early as possible: a notice that comes before
        the first ``now`` is then agreed on a step ahead (it would otherwise be placed before ``step`` and missed)."""
        if jax.process_count() > 1:
            multihost_utils.reached_preemption_sync_point(step)

    def now(self, step: int) -> bool:
        """Whether to stop after ``step`` (all processes get the same answer for the same step)."""
        if jax.process_count() > 1:
            if multihost_utils.reached_preemption_sync_point(step):
                self.received = self.received or "SIGTERM"
                return True
            return False
        return self.received is not None
