"""Partial rollouts carried across RL steps: a pool of groups in flight on the devices, each step
decoding at most rl.rollout_token_budget tokens and training on the groups that ended.

  partial = PartialRollouts(generator, num_groups)                 # generator's scheduler: "budgeted"
  arrays, examples, info = partial.step(params, extra, draw, key, version)
  state = partial.get_state()                                       # JSON, with the checkpoint

Each RL step decodes at most budget // slots steps of the budgeted scheduler (rl/generation/loop.py);
groups whose samples have all ended form the step's batch, the others stay in the pool and continue
at the next step under the new parameters, re-prefilled from their buffers (rl/generation/core.resume).
Each token keeps the behaviour log-prob and the policy version that produced it
(RolloutBatch.policy_version), so a carried sample's segments are told apart. Re-prefilling under the
new parameters (rather than keeping the old cache) makes each new segment exactly the new policy's
continuation of the sequence so far. Approach of Kimi k1.5 (partial rollouts, arXiv:2501.12599, sec.
2.6.2) and Orca's iteration-level scheduling (Yu et al., OSDI 2022).

Axis legend: P group slots, G group size, B = P * G samples, Lp prompt length.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.rl.generation.host import buckets
from meshrl.rl.generation.output import rollout_batch
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.generation.state import Pool
from meshrl.rl.batches.routes import RoutingRows
from meshrl.rl.batches.rows import rollout_rows
from meshrl.sharding import hosts
from meshrl.train.checkpoint import array_from_json, array_to_json

_PER_GROUP = ("prompts", "prompt_mask")


def group_rows(groups: np.ndarray, size: int) -> np.ndarray:
  """The pool rows [F * G] of group slots `groups` [F] (group g: rows g*G .. g*G+G-1)."""
  return (np.asarray(groups)[:, None] * size + np.arange(size)).reshape(-1)


def batch_rows(batch, rows: np.ndarray, *, copy_routes: bool = False) -> dict:
  """Rows `rows` of a RolloutBatch as the step takes them: the per-token fields kept on the devices
  (rl/batches/rows.py), the routes as RoutingRows (rl/batches/routes.py). copy_routes: the routes of
  those rows are taken as a copy, so the batch shares no buffer with a pool that lives on
  (episodes.EpisodeRunner.output)."""
  arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
  routing = arrays.pop("routing")
  arrays = rollout_rows(arrays, rows)
  if routing is not None:
    if copy_routes:  # padded to a bucket of rows (row 0 again): a bounded number of shapes to compile
      sizes = buckets(routing.shape[1])
      taken = np.zeros(sizes[np.searchsorted(sizes, len(rows))], np.int32)
      taken[:len(rows)] = rows
      routing, rows = _take_rows(routing, taken), np.arange(len(rows))
    arrays["routing"] = RoutingRows.of_rollout(routing, rows)
  return arrays


class GroupSlots:
  """The group slots of a pool carried across RL steps (`PartialRollouts`; multi-turn:
  rl/step/episodes.PartialEpisodes): `num_groups` slots of G samples, which of them hold a live
  group, each one's prompt (on the devices) and example, and the admission counter that orders and
  keys new groups."""

  def __init__(self, generator, num_groups: int):
    spec = generator.spec
    slots = spec.num_slots(num_groups * spec.group_size)
    if spec.token_budget < slots:
      raise ValueError(f"rl.rollout_token_budget={spec.token_budget} is less than one token per decode slot "
                       f"(rl.decode_slots resolves to {slots}).")
    self.generator, self.spec, self.num_groups = generator, spec, num_groups
    # Everything carried lives replicated on the mesh from the start, as the generator's programs
    # return it: a first call on arrays of another layout compiles those programs once more.
    replicated = None if generator.mesh is None else NamedSharding(generator.mesh, PartitionSpec())
    self._on_mesh = jax.jit(lambda tree: tree, out_shardings=replicated)
    self._blank_pool = jax.jit(self._blank_fn, out_shardings=replicated)
    self.pool: Pool | None = None
    self.prompts = self._on_mesh(np.zeros((num_groups, spec.prompt_len), np.int32))  # each group slot's prompt
    self.prompt_mask = self._on_mesh(np.zeros((num_groups, spec.prompt_len), bool))
    self.examples: list = [None] * num_groups  # the task example of each group in the pool
    self.live = np.zeros(num_groups, bool)  # group slot holds a group
    self.next_uid = 0  # groups admitted so far (their admission order)
    self.metrics = None
    self._placed = jax.jit(functools.partial(_placed, new_pool=generator.new_pool, group_size=spec.group_size))

  @property
  def group_size(self) -> int:
    return self.spec.group_size

  def _blank_fn(self, prompts, prompt_mask) -> Pool:
    num = self.num_groups * self.group_size
    pool = self.generator.new_pool(prompts, prompt_mask, sample_keys(jax.random.key(0), jnp.arange(num)))
    return pool.replace(done=jnp.ones_like(pool.done))

  def _blank(self) -> Pool:
    """A pool of ended blank groups (every group slot free)."""
    return self._blank_pool(self.prompts, self.prompt_mask)

  def _place(self, free: np.ndarray, examples: list, tokens, mask, key, failed=()) -> None:
    """New groups into the free group slots `free` [F]: their examples, prompts tokens [F, Lp] and
    mask; their samples keyed by (key, admission order); the samples `failed` (rows of the F
    groups) start ended. One jitted program, its F padded to every group slot (the padding dropped),
    so no count of free slots compiles anew in mid-run. Prompts that are a global jax array already
    (several hosts, each encoding its own groups) are placed as they are, at their own count."""
    count = free.size
    size = count if isinstance(tokens, jax.Array) else self.num_groups
    slots = np.full(size, self.num_groups, np.int32)  # group slot P: none
    failed_rows = np.zeros(size * self.group_size, bool)
    slots[:count] = free
    failed_rows[np.asarray(failed, np.int64)] = True
    if size != count:
      tokens, mask = _padded(tokens, size, np.int32), _padded(mask, size, bool)
    self.pool, self.prompts, self.prompt_mask = self._placed(
        self._blank() if self.pool is None else self.pool, self.prompts, self.prompt_mask, slots, tokens, mask,
        key, np.int32(self.next_uid), failed_rows)
    self.next_uid += int(count)
    for i, g in enumerate(free):
      self.examples[g] = examples[i]
    self.live[free] = True

  def _harvest(self, done) -> tuple[np.ndarray, np.ndarray]:
    """The live groups whose samples have all ended (done [B]) -> (their group slots [E], their pool
    rows [E * G]); their group slots are free again."""
    done = hosts.to_host(done).reshape(self.num_groups, self.group_size).all(axis=1)
    ended = np.flatnonzero(done & self.live)
    self.live[ended] = False
    return ended, group_rows(ended, self.group_size)

  def _info(self, admitted: int, ended: np.ndarray) -> dict:
    return {"groups_admitted": admitted, "groups_ended": int(ended.size), "groups_carried": int(self.live.sum())}


class PartialRollouts(GroupSlots):
  """Partial rollouts across RL steps: a pool of `num_groups` groups in flight on the devices.

  Each `step` tops the pool up with new groups (drawn from `draw(count)`), decodes one budgeted call,
  and returns the groups that have ended (all G samples) in the RolloutBatch layout; the rest are
  carried, their tokens, log-probs and versions kept, and resume at the next step under the
  parameters passed then. The generator's proposer (rl.speculative) and options apply as in any call;
  its last call's metrics are in `.metrics`.

  Several host processes: `draw` gives every host the same prompts, so every host holds the same
  pool bookkeeping and every group's example; the ended groups' per-token fields stay on the devices
  (rl/batches/rows.rollout_rows: rows of the pool's batch), and rl/step/program.py scores each host's share of them.
  """

  def __init__(self, generator, num_groups: int):
    if generator.spec.scheduler != "budgeted":
      raise ValueError(f"partial rollouts need the budgeted scheduler (rl.rollout_token_budget > 0), not "
                       f"{generator.spec.scheduler!r}.")
    super().__init__(generator, num_groups)

  def _admit(self, draw: Callable[[int], tuple[list, np.ndarray, np.ndarray]], key) -> int:
    """Fills the free group slots with new groups from `draw(count) -> (examples, tokens, mask)`."""
    free = np.flatnonzero(~self.live)
    if free.size:
      self._place(free, *draw(int(free.size)), key)
    return int(free.size)

  def _decode(self, params, extra, pool: Pool, version):
    """One budgeted call on `pool` -> (pool, its RolloutBatch, the call's metrics)."""
    pool, metrics = self.generator.run_pool(params, extra, pool, self.prompts, self.prompt_mask, version)
    return pool, rollout_batch(pool, self.spec.prompt_len, self.spec.step.pad_id), metrics

  def step(self, params, extra, draw, key, version) -> tuple[dict, list, dict]:
    """One RL step's generation -> (the ended groups' arrays [E * G, ...]: per-token fields kept on
    the devices, rl/batches/rows.rollout_rows; their examples; info). draw(count) -> (examples, tokens [count, Lp],
    mask) supplies new groups; `key` seeds the new groups' samples; `version` is stamped on the tokens
    generated now."""
    return self.dispatch(params, extra, draw, key, version)()

  def dispatch(self, params, extra, draw, key, version) -> Callable[[], tuple[dict, list, dict]]:
    """`step` without waiting (asynchronous RL dispatches the next steps' generation ahead): admits new
    groups and dispatches the budgeted call, and returns `harvest`, which reads which groups ended
    and gives `step`'s result. Harvests run in dispatch order; a group that ended stays live (its slot
    not refilled) until harvested, so a later dispatch resumes only the groups still unfinished."""
    admitted = self._admit(draw, key)
    self.pool, batch, self.metrics = self._decode(params, extra, self.pool, jnp.asarray(version, jnp.int32))
    done_after = self.pool.done

    def harvest() -> tuple[dict, list, dict]:
      ended, rows = self._harvest(done_after)
      return batch_rows(batch, rows), [self.examples[g] for g in ended], self._info(admitted, ended)
    return harvest

  def get_state(self) -> dict:
    """The carried groups as JSON values (for the checkpoint's extra state): the pool's
    arrays, each group slot's prompt, the groups' examples, which group slots are live and the
    admission counter; {} when nothing was drawn yet."""
    if self.pool is None:
      return {}
    arrays = {f.name: hosts.to_host(getattr(self.pool, f.name)) for f in dataclasses.fields(self.pool)
              if getattr(self.pool, f.name) is not None}
    arrays.update(prompts=hosts.to_host(self.prompts), prompt_mask=hosts.to_host(self.prompt_mask))
    return {"arrays": {name: array_to_json(value) for name, value in arrays.items()}, "examples": list(self.examples), "live": self.live.tolist(),
            "next_uid": self.next_uid}

  def set_state(self, state: dict) -> None:
    """Continues from `get_state()`'s output ({}: nothing carried)."""
    if not state:
      return
    arrays = {name: array_from_json(v) for name, v in state["arrays"].items()}
    for name in _PER_GROUP:
      want = getattr(self, name)
      if arrays[name].shape != want.shape:
        raise ValueError(f"carried rollouts: saved {name} has shape {arrays[name].shape}, this run expects "
                         f"{want.shape} (rl.prompts_per_step and rl.max_prompt_len must match the saved run).")
      setattr(self, name, self._on_mesh(np.asarray(arrays.pop(name), want.dtype)))
    blank = self._blank()
    for name, value in arrays.items():
      want = getattr(blank, name, None)
      if want is None or want.shape != value.shape:
        raise ValueError(f"carried rollouts: saved {name} has shape {value.shape}, this run expects "
                         f"{None if want is None else want.shape} (rl.prompts_per_step, rl.group_size, "
                         "rl.max_prompt_len, rl.max_new_tokens and the model must match the saved run).")
    self.pool = self._on_mesh(blank.replace(**{name: np.asarray(value, getattr(blank, name).dtype)
                                               for name, value in arrays.items()}))
    self.examples = list(state["examples"])
    self.live = np.asarray(state["live"], bool)
    self.next_uid = int(state["next_uid"])


def _padded(rows, size: int, dtype) -> np.ndarray:
  """Host rows [F, ...] followed by zero rows up to [size, ...]."""
  rows = np.asarray(rows, dtype)
  out = np.zeros((size,) + rows.shape[1:], dtype)
  out[:len(rows)] = rows
  return out


@jax.jit
def _take_rows(routing: jax.Array, rows: jax.Array) -> jax.Array:
  """routing [L, N, S, K] -> its rows `rows` [R] (a copy) [L, R, S, K]."""
  return jnp.take(routing, rows, axis=1)


def _placed(pool: Pool, prompts, prompt_mask, slots, tokens, mask, key, first_uid, failed, *, new_pool,
            group_size: int):
  """(pool, prompts, prompt_mask) with F new groups in group slots slots [F] (P: none, dropped): their
  prompts tokens, mask [F, Lp]; group i's samples have ids (first_uid + i) * G + j, keyed by
  fold_in(key, id) and ordered by id; failed [F * G] samples start ended. Pure; jit it."""
  num = slots.shape[0]
  sample_ids = ((first_uid + jnp.arange(num, dtype=jnp.int32))[:, None] * group_size
                + jnp.arange(group_size, dtype=jnp.int32)).reshape(-1)
  fresh = new_pool(tokens, mask, sample_keys(key, sample_ids.astype(jnp.uint32)))
  fresh = fresh.replace(priority=sample_ids, done=fresh.done | failed)
  rows = (slots[:, None] * group_size + jnp.arange(group_size, dtype=jnp.int32)).reshape(-1)

  def put(name, old, new):
    if old is None:
      return None
    if name == "group_of":
      return old.at[rows].set(rows // group_size, mode="drop")
    if name == "routing":
      return old.at[:, rows].set(new, mode="drop")
    return old.at[rows].set(new, mode="drop")
  pool = pool.replace(**{f.name: put(f.name, getattr(pool, f.name), getattr(fresh, f.name))
                         for f in dataclasses.fields(pool)})
  return (pool, prompts.at[slots].set(tokens.astype(prompts.dtype), mode="drop"),
          prompt_mask.at[slots].set(mask.astype(prompt_mask.dtype), mode="drop"))
