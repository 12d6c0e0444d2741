"""`SandboxPool`: many sandboxed runs at once on a bounded worker pool.

Each worker thread blocks on one run (the process does the work; the thread only waits and reads
pipes), so `workers` bounds how many programs run at a time. With `warm=True` (the default) each
worker starts the next sandbox (bwrap, namespaces, supervisor) while its current program runs, so
a run's start-up is sending the program to a supervisor that is already waiting; at most `workers`
warm sandboxes idle per distinct `Limits`. A run that crashes, hangs
(the timeout kills it), floods its output or cannot even start comes back as a `SandboxResult`
whose `killed_reason` says what happened; the pool never raises for one run and keeps serving the
others. `stats()` reports per-run start-up latency and the failures by reason.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

from meshrl.rl.sandbox import result as res
from meshrl.rl.sandbox.bwrap import Runtime
from meshrl.rl.sandbox.limits import Limits
from meshrl.rl.sandbox.runner import Launch, Sandbox

INVALID_REQUEST = "invalid_request"


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """Counts and latencies since the pool started; seconds throughout."""
  runs: int
  ok: int  # exited by themselves with status 0
  failures: dict  # {reason kind (killed_reason before ':', or "exit_nonzero"): count}
  recent_failures: tuple  # last few "reason kind: detail" strings
  startup_p50_s: float | None
  startup_p99_s: float | None
  queue_p50_s: float | None  # from submit to a worker taking the run


@dataclasses.dataclass(frozen=True)
class Request:
  """One run for `SandboxPool.map`: the same arguments as `Sandbox.run`."""
  cmd: str | Sequence[str]
  files: Mapping[str, str | bytes] | None = None
  stdin: str | bytes | None = None
  limits: Limits | None = None


class SandboxPool:
  """Runs sandboxes on `workers` threads; thread-safe; a context manager (close() waits).

  Args:
    workers: most programs running at once (>= 1).
    limits: default limits of every run (a run may pass its own).
    runtime: what the sandboxes see read-only (default: the host's /usr).
    warm: start each worker's next sandbox ahead of its run.
  """

  def __init__(self, workers: int = 4, *, limits: Limits | None = None,
               runtime: Runtime | None = None, warm: bool = True):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
      raise ValueError(f"workers={workers!r} must be an integer >= 1.")
    self.workers = workers
    self.warm = warm
    self._ready: dict[Limits, list[Launch]] = {}
    self._closed = False
    self.default = Sandbox(limits, runtime=runtime)
    self._sandboxes = {self.default.limits: self.default}
    self._executor = concurrent.futures.ThreadPoolExecutor(workers, "sandbox")
    self._lock = threading.Lock()
    self._startups: collections.deque = collections.deque(maxlen=10_000)
    self._queues: collections.deque = collections.deque(maxlen=10_000)
    self._failures: collections.Counter = collections.Counter()
    self._recent: collections.deque = collections.deque(maxlen=8)
    self._runs = self._ok = 0

  def _sandbox(self, limits: Limits | None) -> Sandbox:
    if limits is None:
      return self.default
    with self._lock:
      if limits not in self._sandboxes:
        self._sandboxes[limits] = Sandbox(limits, runtime=self.default.runtime)
      return self._sandboxes[limits]

  def submit(self, cmd: str | Sequence[str], *, files: Mapping[str, str | bytes] | None = None,
             stdin: str | bytes | None = None, limits: Limits | None = None
             ) -> concurrent.futures.Future:
    """A Future of the run's SandboxResult (the Future itself never holds an exception)."""
    queued = time.monotonic()
    return self._executor.submit(self._run, Request(cmd, files, stdin, limits), queued)

  def map(self, requests: Iterable[Request]) -> list[res.SandboxResult]:
    """Runs every request concurrently; results in request order."""
    futures = [self.submit(r.cmd, files=r.files, stdin=r.stdin, limits=r.limits)
               for r in requests]
    return [future.result() for future in futures]

  def _take(self, sandbox: Sandbox) -> Launch | res.SandboxResult:
    """A warm launch for `sandbox` if one is alive, else a fresh one."""
    stale, found = [], None
    with self._lock:
      ready = self._ready.get(sandbox.limits, [])
      while ready and found is None:
        launch = ready.pop()
        if launch.alive():
          found = launch
        else:
          stale.append(launch)
    for launch in stale:
      launch.discard()
    return found or sandbox.launch()

  def _replenish(self, sandbox: Sandbox):
    """Best effort: a sandbox that cannot be started now is started cold by the next run."""
    if not self.warm or self._closed:
      return
    with self._lock:
      if len(self._ready.get(sandbox.limits, [])) >= self.workers:
        return
    try:
      launch = sandbox.launch()
    except Exception:  # pylint: disable=broad-except  (e.g. every sandbox uid in use)
      return
    if isinstance(launch, res.SandboxResult):
      return
    with self._lock:
      if self._closed:
        launch.discard()
      else:
        self._ready.setdefault(sandbox.limits, []).append(launch)

  def _run_once(self, request: Request, taken: float) -> res.SandboxResult:
    sandbox = self._sandbox(request.limits)
    payload = sandbox.prepare(request.cmd, files=request.files, stdin=request.stdin)
    launch = self._take(sandbox)
    if isinstance(launch, res.SandboxResult):
      return launch
    launch.send(payload)
    self._replenish(sandbox)  # starts while this run's program does its work
    return sandbox.collect(launch, since=taken)

  def _run(self, request: Request, queued: float) -> res.SandboxResult:
    taken = time.monotonic()
    try:
      result = self._run_once(request, taken)
    except ValueError as error:
      result = res.failed(f"{INVALID_REQUEST}: {error}")
    except Exception as error:  # pylint: disable=broad-except  (the pool must survive)
      result = res.failed(f"{res.SANDBOX_ERROR}: {type(error).__name__}: {error}",
                          wall_s=time.monotonic() - taken)
    self._record(result, taken - queued)
    return result

  def _record(self, result: res.SandboxResult, queue_s: float):
    with self._lock:
      self._runs += 1
      self._queues.append(queue_s)
      if result.startup_s is not None:
        self._startups.append(result.startup_s)
      if result.ok:
        self._ok += 1
        return
      if result.killed_reason is not None:
        kind, detail = result.killed_reason.partition(":")[::2]
      else:
        kind, detail = "exit_nonzero", f" exit {result.exit_code}"
      self._failures[kind] += 1
      self._recent.append(f"{kind}:{detail}"[:300])

  def stats(self) -> PoolStats:
    with self._lock:
      startups = np.asarray(self._startups, np.float64)
      queues = np.asarray(self._queues, np.float64)
      pct = lambda xs, q: float(np.percentile(xs, q)) if xs.size else None
      return PoolStats(runs=self._runs, ok=self._ok, failures=dict(self._failures),
                       recent_failures=tuple(self._recent), startup_p50_s=pct(startups, 50),
                       startup_p99_s=pct(startups, 99), queue_p50_s=pct(queues, 50))

  def close(self):
    """Stops the warm sandboxes, then waits for submitted runs.

    Warm ones go first: bwrap's --die-with-parent follows the thread that started it, so a worker
    thread that exits kills its warm sandbox abruptly (leaving a zombie for init to reap).
    """
    with self._lock:
      self._closed = True
      ready, self._ready = self._ready, {}
    for launches in ready.values():
      for launch in launches:
        launch.discard()
    self._executor.shutdown(wait=True)

  def __enter__(self) -> "SandboxPool":
    return self

  def __exit__(self, *exc):
    self.close()
