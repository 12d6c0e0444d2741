"""The KV cache's host tier (rl.kv_host_bytes): cache rows of paused samples moved off the devices.

An episode waiting on its environment keeps a decode slot, and the slot's cache row, while it
decodes nothing. With a host tier the episodic scheduler (rl/generation/episodic.py) moves such a
slot's row, all of it (the target's and the draft's cache rows, int8 entries with their scales as
stored, the next-token logits, the position, the stop-sequence window), to host memory, frees the
slot for a waiting sample, and when the environment answers moves the row back into a free slot,
bit for bit, where the observation is fed (core.observe) as if the row had never left. The
alternative, dropping the row and re-prefilling the sample from its buffer (core.resume), costs a
forward over every token so far.

Tiers and their budgets: the device tier is the slots' caches (C rows, `row_bytes` each,
`device_bytes`); the host tier holds at most `budget` bytes of rows. A row that does not fit stays
in its slot, paused on the device. Host memory is the memory kind "pinned_host" of the devices
(JAX memory kinds; the CPU backend has it too, /work/shared/research/FACTS.md), else
"unpinned_host"; a backend with neither keeps the rows as numpy arrays (jax.device_get).

A row parked in one call is not carried to the next: a carried sample resumes under that call's
parameters (rl/generation/episodic.py), so its cache is rebuilt from its buffer (`clear`).

Axis legend: C slots, S cache columns, V vocab, W stop-sequence window.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import numpy as np

from meshrl.model import kv_cache as kvc
from meshrl.rl.generation.state import Slots

HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_bytes() -> int:
  """This host's physical memory."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_budget(budget, host_memory: int | None = None) -> int:
  """rl.kv_host_bytes: a whole number of bytes, at most the host's memory -> the budget."""
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
    raise ValueError(f"rl.kv_host_bytes={budget!r} must be a whole number of bytes >= 0 (0 = no host tier).")
  host_memory = host_memory_bytes() if host_memory is None else host_memory
  if budget > host_memory:
    raise ValueError(f"rl.kv_host_bytes={budget} is more than this host's memory ({host_memory} bytes); "
                     "give at most that (0 = no host tier).")
  return int(budget)


def _row_fields(slots: Slots):
  """The per-slot fields a parked row keeps besides its caches (None where the slots have none)."""
  return (slots.logits, slots.position, slots.window, slots.sampling, slots.stops)


@jax.jit
def take_row(slots: Slots, slot: jax.Array) -> dict:
  """Slot `slot`'s row: {"cache", "draft_cache": 1-row caches, "fields": 1-row per-slot fields}."""
  rows = slot[None]
  return {"cache": kvc.take_rows(slots.cache, rows),
          "draft_cache": None if slots.draft_cache is None else kvc.take_rows(slots.draft_cache, rows),
          "fields": jax.tree.map(lambda a: a[rows], _row_fields(slots))}


@functools.partial(jax.jit, donate_argnums=(0,))
def put_row(slots: Slots, slot: jax.Array, sid: jax.Array, row: dict) -> Slots:
  """`slots` with the row `row` (a `take_row`) in slot `slot`, decoding sample `sid`."""
  rows = slot[None]
  logits, position, window, sampling, stops = jax.tree.map(
      lambda a, b: a.at[rows].set(b), _row_fields(slots), row["fields"])
  return slots.replace(sid=slots.sid.at[slot].set(sid), cache=kvc.put_rows(slots.cache, rows, row["cache"]),
                       draft_cache=None if slots.draft_cache is None else kvc.put_rows(
                           slots.draft_cache, rows, row["draft_cache"]),
                       logits=logits, position=position, window=window, sampling=sampling, stops=stops)


def row_bytes(slots: Slots) -> int:
  """Bytes of one slot's row that the tier moves (target and draft caches, per-slot fields), over
  real arrays or their abstract shapes (jax.ShapeDtypeStruct: rl/step/aot.py reports it for a
  topology without allocating): the device tier's bytes / C."""
  leaves = jax.tree.leaves((slots.cache, slots.draft_cache, _row_fields(slots)))
  return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)) // slots.num_slots


def _host_kind(tree) -> str | None:
  """The host memory kind every device of `tree` has, or None."""
  devices = {d for a in jax.tree.leaves(tree) for d in a.sharding.device_set}
  kinds = [set(m.kind for m in d.addressable_memories()) for d in devices]
  return next((k for k in HOST_KINDS if all(k in have for have in kinds)), None)


@dataclasses.dataclass
class Parked:
  """A row in the host tier: its arrays there, their device shardings, its bytes."""
  row: Any
  shardings: Any
  nbytes: int


@dataclasses.dataclass
class TierStats:
  """What the host tier did in a call."""
  parked: int = 0  # rows moved to the host
  restored: int = 0  # rows moved back into a slot
  refused: int = 0  # rows that stayed on the device: the host budget was full
  peak_bytes: int = 0  # most bytes held on the host at once


class HostTier:
  """Rows of paused samples in host memory, at most `budget` bytes (see the module docstring)."""

  def __init__(self, budget: int, *, host_memory: int | None = None):
    self.budget = check_host_budget(budget, host_memory)
    self.parked: dict[int, Parked] = {}
    self.used = 0
    self.stats = TierStats()

  row_bytes = staticmethod(row_bytes)  # bytes of one slot's row (caches and per-slot fields)

  @staticmethod
  def device_bytes(slots: Slots) -> int:
    """Bytes of the device tier: every slot's row."""
    return int(sum(a.nbytes for a in jax.tree.leaves((slots.cache, slots.draft_cache, _row_fields(slots)))))

  def holds(self, sid: int) -> bool:
    return int(sid) in self.parked

  def park(self, slots: Slots, slot: int, sid: int, num_samples: int) -> tuple[Slots, bool]:
    """Moves slot `slot`'s row (sample `sid` of B = num_samples) to the host and frees the slot (sid
    B) -> (slots, moved). A row over the budget's room stays where it is (moved False)."""
    size = self.row_bytes(slots)
    if self.used + size > self.budget:
      self.stats.refused += 1
      return slots, False
    row = take_row(slots, np.int32(slot))
    shardings = jax.tree.map(lambda a: a.sharding, row)
    kind = _host_kind(row)
    if kind is None:
      host = jax.device_get(row)
    else:
      host = jax.device_put(row, jax.tree.map(lambda s: s.with_memory_kind(kind), shardings))
    self.parked[int(sid)] = Parked(host, shardings, size)
    self.used += size
    self.stats.parked += 1
    self.stats.peak_bytes = max(self.stats.peak_bytes, self.used)
    return slots.replace(sid=slots.sid.at[slot].set(num_samples)), True

  def restore(self, slots: Slots, sid: int, slot: int) -> Slots:
    """Moves sample `sid`'s parked row back into (free) slot `slot`."""
    parked = self.parked.pop(int(sid))
    self.used -= parked.nbytes
    self.stats.restored += 1
    row = jax.device_put(parked.row, parked.shardings)
    return put_row(slots, np.int32(slot), np.int32(sid), row)

  def drop(self, sid: int) -> None:
    """Forgets sample `sid`'s parked row (its episode ended)."""
    parked = self.parked.pop(int(sid), None)
    if parked is not None:
      self.used -= parked.nbytes

  def clear(self) -> None:
    """Forgets every parked row (a new call: carried samples resume under its parameters)."""
    self.parked.clear()
    self.used = 0
    self.stats = TierStats()
