"""Pools of persistent sessions (session.py): started ahead, handed to episodes, taken back and recycled.

  with SessionPool(SessionSpec(limits), warm=2, keep=64) as pool:
    session = pool.acquire()        # a warm one (bwrap, supervisor and bash up), its wall clock started
    ...                             # the episode
    pool.release(session)           # recycled in the background (Session.recycle) and kept ready
  sessions = PoolSet(warm=1)        # one pool per SessionSpec (runtime, work dir), made on first use
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Mapping

from meshrl.rl.sandbox.bwrap import Runtime, check_bwrap
from meshrl.rl.sandbox.runner import UID_BASE
from meshrl.rl.sandbox.session import DEFAULT_SESSION_S, Session, SessionSpec, SessionStartError


class SessionPool:
  """Keeps `warm` sessions of `spec` started ahead (bwrap, supervisor and shell up), so an episode's
  session is ready at once, and takes sessions back: `release(session)` recycles an episode's session
  in the background (Session.recycle: every process killed, the mounts emptied, a fresh shell) and
  keeps it ready, up to `keep` in all, so a run whose steps start many episodes at once starts each
  sandbox once, not once per episode (a start costs about 50 ms of CPU, a recycle a few). Thread-safe;
  a context manager (close() ends the ready ones; sessions handed out belong to their takers until
  released).

  Raises SandboxUnavailable at construction where bubblewrap cannot run.
  """

  def __init__(self, spec: SessionSpec | None = None, *, warm: int = 2, keep: int = 64):
    for name, value in (("warm", warm), ("keep", keep)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0.")
    if keep < warm:
      raise ValueError(f"keep={keep} must be at least warm={warm}.")
    self.spec = spec or SessionSpec()
    runtime = self.spec.runtime or Runtime.host()
    check_bwrap(runtime, uid=UID_BASE if os.geteuid() == 0 else None)
    self.warm, self.keep = warm, keep
    self._ready: list[Session] = []
    self._lock = threading.Lock()
    self._closed = False
    self._filling = 0
    self.started = self.taken = self.recycled = 0
    self._returned: queue.SimpleQueue = queue.SimpleQueue()
    self._recycler: threading.Thread | None = None
    self._fill()

  def _fill(self):
    """Starts sessions (in the background) until `warm` are ready or being started."""
    with self._lock:
      missing = self.warm - len(self._ready) - self._filling
      if self._closed or missing <= 0:
        return
      self._filling += missing
    for _ in range(missing):
      threading.Thread(target=self._start_one, daemon=True, name="session-warm").start()

  def _start_one(self):
    try:
      session = Session.launch(self.spec)
    except Exception:  # pylint: disable=broad-except  (best effort: acquire starts one cold)
      session = None
    with self._lock:
      self._filling -= 1
      if session is not None:
        self.started += 1
        if self._closed:
          session.close()
        else:
          self._ready.append(session)

  def acquire(self, *, env: Mapping[str, str] | None = None,
              session_timeout_s: float = DEFAULT_SESSION_S) -> Session:
    """A started session (warm if one is ready, else started now), its wall clock running."""
    if self._closed:
      raise RuntimeError("the session pool is closed.")
    session = None
    with self._lock:
      while self._ready and session is None:
        candidate = self._ready.pop(0)
        if candidate.alive:
          session = candidate
        else:
          candidate.close()
      self.taken += 1
    self._fill()
    if session is not None:
      try:
        session.begin(session_timeout_s, env)
        return session
      except SessionStartError:  # it died while it waited: start one now
        session.close()
    session = Session.launch(self.spec)
    session.begin(session_timeout_s, env)
    return session

  def release(self, session: Session) -> None:
    """Hands back a session this pool gave out, its episode over: recycled and kept ready (in the
    background, so the episode's last step does not wait), or ended when it cannot be (it ended, the
    pool holds `keep`, the pool is closed)."""
    if self._closed or session.spec != self.spec or not session.alive or self.keep == 0:
      session.close()
      return
    with self._lock:
      if self._recycler is None:
        self._recycler = threading.Thread(target=self._recycle_returned, daemon=True,
                                          name="session-recycle")
        self._recycler.start()
    self._returned.put(session)

  def _recycle_returned(self):
    while True:
      session = self._returned.get()
      if self._closed or not session.recycle():
        session.close()
        continue
      with self._lock:
        kept = not self._closed and len(self._ready) < self.keep
        if kept:
          self._ready.append(session)
          self.recycled += 1
      if not kept:
        session.close()

  def close(self):
    with self._lock:
      self._closed = True
      ready, self._ready = self._ready, []
    for session in ready:
      session.close()

  def __enter__(self) -> "SessionPool":
    return self

  def __exit__(self, *exc):
    self.close()




class PoolSet:
  """One SessionPool per SessionSpec, made on first use (tasks of different runtimes or work
  directories need different sandboxes); thread-safe; a context manager."""

  def __init__(self, *, warm: int = 1, keep: int = 64):
    self.warm, self.keep = warm, keep
    self._pools: dict[SessionSpec, SessionPool] = {}
    self._lock = threading.Lock()

  def pool(self, spec: SessionSpec) -> SessionPool:
    with self._lock:
      if spec not in self._pools:
        self._pools[spec] = SessionPool(spec, warm=self.warm, keep=self.keep)
      return self._pools[spec]

  def release(self, session: Session) -> None:
    """SessionPool.release on the pool of the session's spec."""
    self.pool(session.spec).release(session)

  def acquire(self, spec: SessionSpec, *, env: Mapping[str, str] | None = None,
              session_timeout_s: float = DEFAULT_SESSION_S) -> Session:
    return self.pool(spec).acquire(env=env, session_timeout_s=session_timeout_s)

  def close(self):
    with self._lock:
      pools, self._pools = list(self._pools.values()), {}
    for pool in pools:
      pool.close()

  def __enter__(self) -> "PoolSet":
    return self

  def __exit__(self, *exc):
    self.close()
