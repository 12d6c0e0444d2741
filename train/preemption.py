"""Preemption: SIGTERM or Ctrl-C asks a training loop to save and stop at the end of the current step.

  with Preemption() as preemption:        # installs the handler (main thread), restores it after
    for step in ...:
      ...one step...
      if preemption.requested():          # every host agrees (one tiny all-gather on multi-host)
        save(step, force=True); break

Cloud schedulers (GKE, Slurm, TPU maintenance events) send SIGTERM and allow a grace period before
SIGKILL. The handler only sets a flag, so a step in flight (or an async save) is never torn; the loop
saves at the step's end and the process exits 0. A second SIGTERM while the flag is set is ignored
(a run saving its last checkpoint is not killed by a repeated signal); SIGKILL cannot be caught,
and orbax's atomic finalize keeps the previous checkpoint intact then.

Ctrl-C (SIGINT) is the same request from a person at a terminal: the first one prints what happens
and saves like SIGTERM; a second one raises KeyboardInterrupt at once (someone who presses it twice
wants out now; checkpoints already committed stay intact), which scripts turn into one line
(configs/cli.run).
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np


class Preemption:
  """A flag set by SIGTERM, SIGINT (and any other `signals`) while the context is entered.

  Args:
    signals: the signals that request a stop (default SIGTERM and SIGINT).
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.signal_name: str | None = None  # the name of the signal received, e.g. "SIGTERM"
    self._flag = threading.Event()
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
    if not self._flag.is_set():
      self.signal_name = signal.Signals(signum).name
      self._flag.set()
      if signum == signal.SIGINT:  # os.write: print is not safe inside a signal handler
        os.write(2, b"\nCtrl-C: finishing the step in flight, then saving it and stopping; press "
                 b"Ctrl-C again to stop at once without saving it.\n")
    elif signum == signal.SIGINT:
      raise KeyboardInterrupt

  def request(self, name: str = "request") -> None:
    """Sets the flag from code (tests, a watchdog thread)."""
    self.signal_name = self.signal_name or name
    self._flag.set()

  def requested(self) -> bool:
    """Whether a stop was requested: on this host, or (multi-host) on any host, so that every host
    saves the same step and stops together."""
    local = self._flag.is_set()
    if jax.process_count() == 1:
      return local
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return bool(np.any(multihost_utils.process_allgather(np.asarray(local))))

  def stopped_message(self, what: str, step: int, num_steps: int, saved: bool) -> str:
    """The line a loop prints when it stops early for this request, e.g. "SIGTERM: stopped after RL
    step 3 of 100, saved in the checkpoint of step 3; run the same command again to resume."."""
    where = "saved in the checkpoint of step" if saved else "no checkpoint (disabled) at"
    return (f"{self.signal_name}: stopped after {what} step {step} of {num_steps}, {where} {step}; "
            "run the same command again to resume.")

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is threading.main_thread():  # signal handlers live there only
      for signum in self.signals:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()
