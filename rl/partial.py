"""Partial rollouts carried across RL steps: a pool of groups in flight on the devices, each step
decoding at most rl.rollout_token_budget tokens and training on the groups that ended.

  partial = PartialRollouts(cfg, mesh, stop_ids=..., pad_id=...)     # rl.rollout_token_budget > 0
  arrays, examples, info = partial.step(params, extra, draw, key, version)
  state = partial.get_state()                                           # JSON, with the checkpoint

Each RL step decodes at most budget // slots iterations of the continuous engine (rl/engine.py
`run_pool`); groups whose samples have all ended form the step's batch, the others stay in the pool
and continue at the next step under the new parameters (re-prefilled). Each token keeps the
behaviour log-prob and the policy version that produced it (RolloutBatch.policy_version; rl/step.py
stamps the optimizer step count), so a carried sample's segments are told apart. Re-prefilling under
the new parameters (rather than keeping the old cache) makes each new segment exactly the new
policy's continuation of the sequence so far. Approach of Kimi k1.5 (partial rollouts,
arXiv:2501.12599, sec. 2.6.2) and Orca's iteration-level scheduling (Yu et al., OSDI 2022).

Axis legend: P prompts (groups), G group size, B = P * G samples, Lp prompt length.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshrl.rl.engine import (Pool, engine_setup, new_pool, resolve_slots, routing_shape, run_pool,
                              run_pool_speculative, to_rollout_batch)
from meshrl.rl.rollout import rollout_rows, with_generation_weights
from meshrl.rl.routes import RoutingRows
from meshrl.rl.sampling import sample_keys
from meshrl.rl.speculative import SpecConfig, speculative_setup
from meshrl.sharding import hosts
from meshrl.train.checkpoint import array_from_json, array_to_json


class PartialRollouts:
  """Partial rollouts across RL steps: a pool of `num_groups` groups in flight on the devices.

  Each `step` tops the pool up with new groups (drawn from `draw(count)`), decodes at most
  rl.rollout_token_budget // slots iterations, and returns the groups that have ended (all G
  samples) in the RolloutBatch layout; the rest are carried, their tokens, log-probs and versions
  kept, and resume at the next step under the parameters passed then. With rl.speculative the slots
  speculate (`run_pool_speculative`; a carried sample's draft rows are re-prefilled too) and the last
  step's SpecMetrics are in `.metrics`; draft as in make_engine.

  Several host processes: `draw` gives every host the same prompts, so every host holds the same
  pool bookkeeping and every group's example; the ended groups' per-token fields stay on the devices
  (rl/rollout.rollout_rows: rows of the pool's batch), and rl/step.py scores each host's share of
  them from their response columns, gathered to every host.
  """

  def __init__(self, cfg, mesh: Mesh | None, *, stop_ids: tuple[int, ...], pad_id: int,
               num_groups: int | None = None, draft: tuple[Any, Any] | None = None):
    mc, graphdef, spec = engine_setup(cfg, mesh, stop_ids, pad_id, None, None)
    self.spec, self.pad_id = spec, pad_id
    self.num_groups = cfg.rl.prompts_per_step if num_groups is None else num_groups
    num = self.num_groups * spec.group_size
    self.slots = resolve_slots(cfg.rl.decode_slots, num)
    budget = cfg.rl.rollout_token_budget
    if budget < self.slots:
      raise ValueError(f"rl.rollout_token_budget={budget} is less than one token per decode slot "
                       f"(rl.decode_slots resolves to {self.slots}).")
    self.max_steps = budget // self.slots
    self.prompt_len = cfg.rl.max_prompt_len
    self.routing_shape = routing_shape(mc)
    self.pool: Pool | None = None
    self.examples: list = [None] * self.num_groups  # the task example of each group in the pool
    self.live = np.zeros(self.num_groups, bool)  # group slot holds a group
    self.next_uid = 0  # groups admitted so far (their admission order)
    self.metrics = None  # the last step's SpecMetrics (rl.speculative != "none")
    sc = SpecConfig.from_config(cfg, need_checkpoint=draft is None) if cfg.rl.speculative != "none" else None
    draft_graph = draft_rest = None
    self._draft_params = None
    if sc is not None:
      draft_graph, self._draft_params, draft_rest = speculative_setup(cfg, mesh, mc, spec, sc, draft)

    def decode(params, extra, draft_state, pool, version):
      model = nnx.merge(graphdef, params, extra)
      if sc is None:
        pool, prompt_routing = run_pool(model, spec, pool, slots=self.slots, max_steps=self.max_steps,
                                        version=version)
        return pool, to_rollout_batch(pool, prompt_routing, pad_id), None
      draft_model = None if draft_graph is None else nnx.merge(draft_graph, draft_state, draft_rest)
      pool, prompt_routing, metrics = run_pool_speculative(model, draft_model, spec, sc, pool, slots=self.slots,
                                                           max_steps=self.max_steps, version=version)
      return pool, to_rollout_batch(pool, prompt_routing, pad_id), metrics
    self._decode = with_generation_weights(cfg, mesh, mc, decode)

  def _admit(self, draw: Callable[[int], tuple[list, np.ndarray, np.ndarray]], key) -> int:
    """Fills the free group slots with new groups from `draw(count) -> (examples, tokens, mask)`."""
    free = np.flatnonzero(~self.live)
    if free.size == 0:
      return 0
    examples, tokens, mask = draw(int(free.size))
    group_size = self.spec.group_size
    uids = self.next_uid + np.arange(free.size)
    self.next_uid += int(free.size)
    sample_ids = (uids[:, None] * group_size + np.arange(group_size)).reshape(-1)
    fresh = new_pool(tokens, mask, sample_keys(key, jnp.asarray(sample_ids, jnp.uint32)),
                     group_size=group_size, max_new_tokens=self.spec.max_new_tokens, pad_id=self.pad_id,
                     routing_shape=self.routing_shape)
    fresh = fresh.replace(priority=jnp.asarray(sample_ids, jnp.int32))
    if self.pool is None:
      blank = np.zeros((self.num_groups, self.prompt_len), np.int32)
      self.pool = new_pool(blank, blank.astype(bool), sample_keys(key, jnp.arange(
          self.num_groups * group_size)), group_size=group_size, max_new_tokens=self.spec.max_new_tokens,
          pad_id=self.pad_id, routing_shape=self.routing_shape)
      self.pool = self.pool.replace(done=jnp.ones_like(self.pool.done))
    self.pool = _place_groups(self.pool, fresh, free, group_size)
    for i, g in enumerate(free):
      self.examples[g] = examples[i]
    self.live[free] = True
    return int(free.size)

  def get_state(self) -> dict:
    """JSON state of the carried groups (for the checkpoint's extra state): the pool's arrays,
    the groups' examples, which group slots are live and the admission counter."""
    if self.pool is None:
      return {}
    arrays = {f: getattr(self.pool, f) for f in self.pool.__dataclass_fields__}
    return {"arrays": {name: array_to_json(hosts.to_host(value)) for name, value in arrays.items()
                       if value is not None},
            "examples": list(self.examples), "live": self.live.tolist(), "next_uid": self.next_uid}

  def set_state(self, state: dict) -> None:
    """Continues from `get_state()`'s output ({}: nothing carried)."""
    if not state:
      return
    arrays = {name: jnp.asarray(array_from_json(v)) for name, v in state["arrays"].items()}
    fresh = new_pool(np.zeros((self.num_groups, self.prompt_len), np.int32),
                     np.zeros((self.num_groups, self.prompt_len), bool), sample_keys(jax.random.key(0), jnp.arange(
                         self.num_groups * self.spec.group_size)), group_size=self.spec.group_size,
                     max_new_tokens=self.spec.max_new_tokens, pad_id=self.pad_id,
                     routing_shape=self.routing_shape)
    for name, value in arrays.items():
      want = getattr(fresh, name)
      if want is None or want.shape != value.shape:
        raise ValueError(f"carried rollouts: saved {name} has shape {value.shape}, this run expects "
                         f"{None if want is None else want.shape} (rl.prompts_per_step, rl.group_size, "
                         "rl.max_prompt_len, rl.max_new_tokens and the model must match the saved run).")
    self.pool = fresh.replace(**arrays)
    self.examples = list(state["examples"])
    self.live = np.asarray(state["live"], bool)
    self.next_uid = int(state["next_uid"])

  def step(self, params, extra, draw, key, version) -> tuple[dict, list, dict]:
    """One RL step's generation -> (the ended groups' arrays [E * G, ...]: per-token fields kept on
    the devices, rl/rollout.rollout_rows; their examples; info). draw(count) -> (examples, tokens [count, Lp], mask) supplies new groups; `key` seeds
    the new groups' samples; `version` is stamped on the tokens generated now."""
    admitted = self._admit(draw, key)
    self.pool, batch, self.metrics = self._decode(params, extra, self._draft_params, self.pool,
                                                  jnp.asarray(version, jnp.int32))
    done = hosts.to_host(self.pool.done).reshape(self.num_groups, self.spec.group_size).all(axis=1)
    ended = np.flatnonzero(done & self.live)
    rows = (ended[:, None] * self.spec.group_size + np.arange(self.spec.group_size)).reshape(-1)
    arrays = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
    routing = arrays.pop("routing")
    arrays = rollout_rows(arrays, rows)  # the ended rows, kept on the devices (rl/rows.py)
    if routing is not None:  # stays on the devices (rl/routes.py)
      arrays["routing"] = RoutingRows.of_rollout(routing, rows)
    examples = [self.examples[g] for g in ended]
    self.live[ended] = False
    carried = int(self.live.sum())
    return arrays, examples, {"groups_admitted": admitted, "groups_ended": int(ended.size),
                              "groups_carried": carried}


def _place_groups(pool: Pool, fresh: Pool, where: np.ndarray, group_size: int) -> Pool:
  """pool with its groups `where` [F] (group slots) replaced by fresh's F groups (in order)."""
  rows = jnp.asarray((where[:, None] * group_size + np.arange(group_size)).reshape(-1))
  groups = jnp.asarray(where)

  def put(name, old, new):
    if old is None:
      return None
    if name in ("prompts", "prompt_mask"):
      return old.at[groups].set(new)
    if name == "group_of":
      return old.at[rows].set(rows // group_size)
    if name == "routing":
      return old.at[:, rows].set(new)
    return old.at[rows].set(new)
  return pool.replace(**{f: put(f, getattr(pool, f), getattr(fresh, f)) for f in pool.__dataclass_fields__})
