"""The episodic scheduler: samples that pause at the end of each turn while the host answers them.

A sample of a multi-turn episode decodes in its slot until its turn ends (a stop token, a stop
sequence such as `</cmd>`, or the turn's or episode's token limit: core.StepConfig.pause_on_stop).
It then pauses; the host reads the turn, asks `respond` for what comes next (an environment step in a
worker thread: a Future of the observation's tokens, or of None when the episode is over) and, when
the answer arrives, feeds the observation into the slot at its own cache index (core.observe) or
finishes the sample and gives the slot to a waiting one. The other slots keep decoding meanwhile, so
no episode waits for the slowest environment.

  barrier=False  (episodic) answers are fed as they arrive, between decode chunks of `chunk_steps`;
  barrier=True   (static, turn-synchronous) answers are held until no slot is decoding and every
                 paused sample has its answer: every turn of every episode waits for the slowest.
Both feed the same tokens: a sample's t-th policy token draws with the key (sample, t), so with the
same environments both give the same episodes, token for token.

With a host tier (`host_bytes`, rl.kv_host_bytes; rl/generation/tiers.py), a paused sample whose
answer is pending gives up its slot when fresh samples wait for one: its cache row moves to host
memory, and back into a free slot when its answer arrives (no re-prefill), within the tier's budget.

A step budget (`max_steps`, partial rollouts) ends a call early; samples that have not finished stay
in the pool, and answers still pending stay with the scheduler, for the next call, which resumes the
samples from their buffers (core.resume) under the parameters of that call.

Several host processes: each host answers the samples it owns (`owns`); the answers are gathered
(sharding/hosts.gather_objects) so every host calls the same programs with the same arguments.

Axis legend: B samples, C slots, R rows fed at once, T observation tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.rl.generation import host
from meshrl.rl.generation.host import SlotEngine
from meshrl.rl.generation.state import Counters, Pool
from meshrl.rl.generation.tiers import HostTier
from meshrl.sharding import hosts


@dataclasses.dataclass(frozen=True)
class Turn:
  """A finished turn, for `respond`: the sample, the turn's policy tokens, whether it ended on a stop
  token or stop sequence (else a token limit), and the sample's policy tokens so far."""
  sample: int
  tokens: np.ndarray
  stopped: bool
  generated: int
  count: int


Respond = Callable[[Turn], "concurrent.futures.Future[Optional[list[int]]]"]


@dataclasses.dataclass
class Stats:
  """What a call did, for metrics."""
  decode_calls: int = 0
  extend_calls: int = 0
  extend_tokens: int = 0
  extend_slots: int = 0  # rows x padded length fed by the extensions
  host_wait_s: float = 0.0  # time the devices sat idle waiting for answers
  counters: Counters | None = None
  tier: Any = None  # the host tier's TierStats (rows parked, restored, refused; peak bytes), or None


class EpisodicScheduler:
  """Runs a pool of episodes on a SlotEngine's slots (see the module docstring).

  engine: the jitted programs; chunk_steps: decode steps between looks at the host; barrier: turn-
  synchronous (the static multi-turn rollout); max_obs_tokens: the longest observation (T);
  turn_width: columns read back per finished turn (the longest turn); host_bytes: the KV cache's
  host tier (0: none)."""

  def __init__(self, engine: SlotEngine, *, chunk_steps: int, barrier: bool, max_obs_tokens: int,
               turn_width: int, owns: Callable[[int], bool] = lambda sample: True, host_bytes: int = 0):
    self.engine, self.chunk_steps, self.barrier = engine, chunk_steps, barrier
    self.obs_buckets = host.buckets(max_obs_tokens)
    self.row_buckets = host.buckets(engine.num_slots)
    self.turn_width, self.owns = turn_width, owns
    self.pending: dict[int, concurrent.futures.Future] = {}  # this host's unanswered turns
    self.answers: dict[int, Optional[list[int]]] = {}  # gathered answers not yet fed
    self.tier = HostTier(host_bytes) if host_bytes else None

  def run(self, weights, pool: Pool, prompts, prompt_mask, respond: Respond, *, version,
          max_steps: int = 0) -> tuple[Pool, Stats]:
    """Decodes the pool's episodes until every one has finished (or `max_steps` decode steps ran) ->
    (pool, stats). prompts [P, Lp] (left-padded) are the episodes' first observations, shared by each
    group; samples with tokens already (carried) resume from their buffers."""
    engine, stats = self.engine, Stats()
    num = pool.num_samples
    version = jnp.asarray(version, jnp.int32)
    prompt_rows = engine.prefill(weights, prompts, prompt_mask)
    slots = engine.empty(weights, num, prompt_rows[2].shape[-1])
    if self.tier is not None:
      self.tier.clear()  # carried samples resume under this call's parameters
    view = host.read(slots, pool)
    fresh = view["count"] == prompts.shape[1]
    carried = np.flatnonzero(~view["done"] & ~fresh)
    if carried.size:
      slots, pool, view = self._place(weights, slots, pool, carried)
    steps = 0
    counters = engine.counters(weights, num)
    while True:
      slots, pool, view = self._admit(weights, slots, pool, prompt_rows, view)
      live = self._live(view)
      if live.any() and (not max_steps or steps < max_steps):
        chunk = self.chunk_steps if not max_steps else min(self.chunk_steps, max_steps - steps)
        slots, pool, counters = engine.decode(weights, slots, pool, version, counters, steps=chunk)
        stats.decode_calls += 1
        view = host.read(slots, pool, steps=counters.steps)  # the totals stay on the devices
        steps = int(view["steps"])
      self._ask(pool, view, respond)
      slots, view = self._park(slots, view)
      decoding = self._live(view).any() and (not max_steps or steps < max_steps)
      self._collect(block=not decoding, stats=stats)
      if self.barrier and (decoding or self._any_pending()):
        continue
      if self.answers:
        slots, pool, view = self._feed(weights, slots, pool, view, stats)
        continue
      if view["done"].all() or (max_steps and steps >= max_steps and not self._live(view).any()) or (
          not decoding and not self._any_pending() and not self._waiting(view).size):
        break
    stats.counters = counters
    stats.tier = None if self.tier is None else dataclasses.replace(self.tier.stats)
    return pool, stats

  # --- host bookkeeping ------------------------------------------------------------------------------

  @staticmethod
  def _live(view) -> np.ndarray:
    """[C] bool: slots decoding a sample."""
    num = view["done"].shape[0]
    sid = np.minimum(view["sid"], num - 1)
    return (view["sid"] < num) & ~view["done"][sid] & ~view["paused"][sid]

  @staticmethod
  def _waiting(view) -> np.ndarray:
    """Samples not in a slot that can decode (not done, not paused): their ids, lowest first."""
    num = view["done"].shape[0]
    in_slot = np.zeros(num, bool)
    in_slot[view["sid"][view["sid"] < num]] = True
    return np.flatnonzero(~in_slot & ~view["done"] & ~view["paused"])

  def _any_pending(self) -> bool:
    return any(hosts.gather_objects([len(self.pending)]))

  def _ask(self, pool: Pool, view, respond: Respond) -> None:
    """Sends every newly paused sample this host owns to `respond`."""
    asked = [b for b in np.flatnonzero(view["paused"]) if int(b) not in self.pending and int(b) not in self.answers]
    if not asked:
      return
    # Padded to a bucket of rows (sample 0, ending at column 0: read and ignored): one compile per
    # bucket, not one per count of newly paused samples.
    rows = host.buckets(pool.num_samples)
    ids, ends = np.zeros((2, rows[np.searchsorted(rows, len(asked))]), np.int32)
    ids[:len(asked)], ends[:len(asked)] = asked, view["count"][asked]
    turns = np.asarray(host.read_tokens(pool.tokens, ids, ends, self.turn_width))
    for i, b in enumerate(asked):
      b = int(b)
      length = int(view["generated"][b] - view["turn_start"][b])
      if self.owns(b):
        turn = Turn(sample=b, tokens=turns[i, self.turn_width - length:], stopped=bool(view["stopped"][b]),
                    generated=int(view["generated"][b]), count=int(view["count"][b]))
        self.pending[b] = respond(turn)
      else:
        self.pending.setdefault(b, None)  # another host answers it; its answer arrives by gathering

  def _collect(self, *, block: bool, stats: Stats) -> None:
    """Moves answered turns (every host's, gathered) from pending to answers; waits for one when
    `block` and this host has futures pending."""
    mine = {b: f for b, f in self.pending.items() if f is not None}
    if block and mine and not any(f.done() for f in mine.values()):
      t0 = time.perf_counter()
      concurrent.futures.wait(list(mine.values()), timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
      stats.host_wait_s += time.perf_counter() - t0
    done = [[b, f.result()] for b, f in mine.items() if f.done()]
    for b, answer in hosts.gather_objects(done):
      self.answers[int(b)] = None if answer is None else [int(t) for t in answer]
      self.pending.pop(int(b), None)

  def _feed(self, weights, slots, pool, view, stats: Stats):
    """Feeds the gathered answers: observations into their slots (batched by length buckets),
    finished samples out of theirs."""
    engine, answers = self.engine, self.answers
    self.answers = {}
    slot_of = {int(b): c for c, b in enumerate(view["sid"]) if b < view["done"].shape[0]}
    finished = [b for b, answer in answers.items() if answer is None or not answer]
    for b in finished if self.tier is not None else ():
      self.tier.drop(b)
    if finished:  # padded to B (sample id B: none): one shape compiles
      ids = np.full(pool.num_samples, pool.num_samples, np.int32)
      ids[:len(finished)] = finished
      slots, pool = engine.finish(slots, pool, ids)
    observed = [(slot_of[b], answer) for b, answer in answers.items() if answer and b in slot_of]
    if observed:
      rows = self.row_buckets[np.searchsorted(self.row_buckets, len(observed))]
      span = self.obs_buckets[np.searchsorted(self.obs_buckets, max(len(a) for _, a in observed))]
      slot_rows = np.full(rows, engine.num_slots, np.int32)
      tokens = np.zeros((rows, span), np.int32)
      lengths = np.zeros(rows, np.int32)
      for i, (slot, answer) in enumerate(observed):
        slot_rows[i], lengths[i] = slot, len(answer)
        tokens[i, :len(answer)] = answer
      slots, pool = engine.observe(weights, slots, pool, slot_rows, tokens, lengths)
      stats.extend_calls += 1
      stats.extend_tokens += int(lengths.sum())
      stats.extend_slots += rows * span
    unplaced = [b for b, answer in answers.items() if answer and b not in slot_of]
    if unplaced:  # a carried sample paused when its last call ended: resume it, then feed it
      slots, pool, view = self._place(weights, slots, pool, np.asarray(unplaced))
      self.answers.update({b: answers[b] for b in unplaced})
      return slots, pool, view
    return slots, pool, host.read(slots, pool)

  def _park(self, slots, view):
    """Moves the rows of paused samples whose answers are pending to the host tier, as many as fresh
    samples wait beyond the free slots (and the budget allows), freeing their slots."""
    if self.tier is None:
      return slots, view
    num = view["done"].shape[0]
    fresh = [b for b in self._waiting(view) if view["generated"][b] == 0 and int(b) not in self.answers]
    wanted = len(fresh) - int(np.sum(view["sid"] >= num))
    parked = False
    for slot, b in enumerate(view["sid"]):
      if wanted <= 0:
        break
      if b < num and view["paused"][b] and int(b) in self.pending:
        slots, moved = self.tier.park(slots, slot, int(b), num)
        parked |= moved
        wanted -= moved
        if not moved:
          break
    if parked:
      view = dict(view, sid=np.asarray(jax.device_get(slots.sid)))
    return slots, view

  def _place(self, weights, slots, pool, samples: np.ndarray):
    """Puts `samples` into free slots, as many as fit: rows parked in the host tier moved back, the
    others (carried from an earlier call) re-prefilled from their buffers."""
    view = host.read(slots, pool)
    if self.tier is not None and any(self.tier.holds(b) for b in samples):
      free = list(np.flatnonzero(view["sid"] >= view["done"].shape[0]))
      rest = []
      for b in samples:
        if self.tier.holds(b) and free:
          slots = self.tier.restore(slots, int(b), int(free.pop(0)))
        else:
          rest.append(b)
      samples = np.asarray(rest, np.int64)
      view = host.read(slots, pool)
      if not samples.size:
        return slots, pool, view
    free = np.flatnonzero(view["sid"] >= view["done"].shape[0])[:len(samples)]
    if free.size:
      rows = np.full(self.engine.num_slots, self.engine.num_slots, np.int32)
      sid = np.full(self.engine.num_slots, view["done"].shape[0], np.int32)
      rows[:free.size], sid[:free.size] = free, samples[:free.size]
      slots = self.engine.resume(weights, slots, pool, rows, sid)
      view = host.read(slots, pool)
    return slots, pool, view

  def _admit(self, weights, slots, pool, prompt_rows, view):
    """Fresh waiting samples (no token yet) into free slots, lowest id first."""
    num = view["done"].shape[0]
    free = np.flatnonzero(view["sid"] >= num)
    waiting = [b for b in self._waiting(view) if view["generated"][b] == 0 and int(b) not in self.answers]
    take = min(free.size, len(waiting))
    if not take:
      return slots, pool, view
    rows = np.full(self.engine.num_slots, self.engine.num_slots, np.int32)
    sid = np.full(self.engine.num_slots, num, np.int32)
    rows[:take], sid[:take] = free[:take], waiting[:take]
    slots, pool = self.engine.admit(weights, slots, pool, prompt_rows, rows, sid)
    return slots, pool, host.read(slots, pool)
