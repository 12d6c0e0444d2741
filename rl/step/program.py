"""The one RL step program: collect -> score -> advantages -> update.

`scripts/rl.py`, `scripts/bench_rl.py`, `scripts/eval.py` and the tests all drive this module:

  run = build_run(cfg, mesh, model, tokenizer)       # the jitted programs, built once
  metrics = rl_step(run, examples, key)               # one step; run.state is replaced

  collect   rollout(s) on the devices (jit) -> ScoredBatch, scored on the host's RewardPool, with
            DAPO dynamic sampling; the samples' tokens stay on the devices (rl/batches/rows.DeviceRows: the
            host moves rows and pulls only the response columns it scores)
  prepare   ScoredBatch -> UpdateBatch: prediction-aligned arrays, reference log-probs and critic
            values (jit), advantages (jit, `advantages.make_advantages`), zigzag for ring attention
            or packing, built on the devices from the rows; routing replay's MoE routes assembled
            there too (rl/batches/routes.py), never on the host
  update    the jitted policy/critic update over epochs x minibatches (rl/algo/update.py)

Logging, evaluation and checkpoints are hooks of the driver (rl/step/driver.py), not part of the step. The
rollout and the update read and replace the same `run.state.params` arrays on the one mesh.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.algo import advantages as adv_lib
from meshrl.rl.algo import losses
from meshrl.rl.batches import packing
from meshrl.rl.batches import routes
from meshrl.rl.step.groups import (batch_metrics, empty_scored, enough_groups, gather_scoring_info, next_prompts,
                                   response_columns, shared_prompts, staleness, start_scoring, step_groups)
from meshrl.rl.batches.handover import (ScoredBatch, UpdateBatch, align_for_update, align_on_devices,
                               device_put_batch, zigzag_batch)
from meshrl.rl.batches.layouts import sample_layout
from meshrl.rl.step.partial import PartialRollouts
from meshrl.rl.step.bootstrap import Bootstrap
from meshrl.rl.step.replay import SuccessReplay, with_replay
from meshrl.rl.step.episodes import PartialEpisodes
from meshrl.rl.step.episode_collect import collect_multiturn
from meshrl.rl.batches.rows import rollout_rows
from meshrl.rl.step.run_spec import RunSpec, build_spec
from meshrl.rl.step.spec import episode_runner, make_generator
from meshrl.rl.batches.routes import RoutingRows
from meshrl.rl.batches.rows import DeviceRows
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.rewards.sources import SourcedRewards, normalize_per_domain, reward_pool
from meshrl.rl.algo.update import make_logprob_fn, make_update
from meshrl.sharding import hosts
from meshrl.sharding.rules import logical_to_spec, rules_from_config
from meshrl.train.checkpoint import array_from_json, array_to_json
from meshrl.train.optim import make_optimizer
from meshrl.train.sft import zigzag_shards
from meshrl.train.state import TrainState, create_train_state


@dataclasses.dataclass
class RLRun:
  """Everything a step needs; built once by `build_run`."""
  cfg: Any
  mesh: Any
  graphdef: Any
  state: TrainState
  ref_params: Any  # the initial params, kept only when a KL term is on (else None)
  spec: losses.LossSpec
  estimator: Any
  rollout: Any  # jitted (params, extra, prompts, mask, key) -> RolloutBatch
  update: Any  # jitted (state, UpdateBatch, key) -> (state, metrics)
  logprob_fn: Any  # jitted (params, extra, UpdateBatch) -> (logp, values)
  advantages_fn: Any  # jitted, advantages.make_advantages
  tokenizer: Tokenizer
  pool: RewardPool  # or rl/rewards/sources.SourcedRewards (model sources per domain): the same interface
  batch_sharding: Any  # NamedSharding of [B, S] update arrays, or None without a mesh
  zigzag_shards: int  # > 1: update batches are laid out zigzag over the sequence axis
  samples_sharding: Any = None  # NamedSharding of [samples, S] contiguous arrays (packed updates' advantages)
  partial: Any = None  # rl/step/partial.PartialRollouts (multi-turn: rl/step/episodes.PartialEpisodes) when
  #                      rl.rollout_token_budget > 0: groups carried over
  version: int = 0  # policy version: RL updates applied so far (restored with the checkpoint's step)
  in_flight: collections.deque = dataclasses.field(default_factory=collections.deque)  # InFlight
  multiturn: Any = None  # rl/step/episodes.EpisodeRunner when episodes are multi-turn (else None)
  env_work: Any = None  # rl/envs/env_work.EnvWork: the run's quarantine (in the checkpoint), episodes' starts
  episode_thread: Any = None  # asynchronous multi-turn RL: the executor running episodes beside the update
  bootstrap: Any = None  # rl/step/bootstrap.Bootstrap (issue 33: level curriculum, retries of unsolved prompts)
  replay: Any = None  # rl/step/replay.SuccessReplay (issue 33: verified successes replayed), rl.replay_groups > 0
  run_spec: RunSpec | None = None  # the config read and checked (rl/step/run_spec.py); build_run sets it

  def close(self) -> None:
    self.pool.close()
    if self.episode_thread is not None:
      self.episode_thread.shutdown(wait=True)
    if self.multiturn is not None:
      self.multiturn.close()


def build_run(cfg, mesh, model, tokenizer: Tokenizer, *, env_work=None, spec: RunSpec | None = None) -> RLRun:
  """The train state of `model` and the run's jitted programs (nothing is compiled yet), built from
  the run spec (`spec`, default build_spec(cfg, mesh): the config checked). env_work: the run's
  rl/envs/env_work.EnvWork (multi-turn episodes start their environments through it; a verifier's
  sample given up on after its infrastructure retries is recorded in its quarantine)."""
  run_spec = build_spec(cfg, mesh, tokenizer=tokenizer) if spec is None else spec
  estimator = run_spec.estimator
  zigzag_over = zigzag_shards(cfg, mesh)
  spec = dataclasses.replace(run_spec.loss, zigzag_inputs=zigzag_over > 1)
  tx = make_optimizer(cfg.optim)
  graphdef, state = create_train_state(model, tx, mesh)
  sharding = samples_sharding = None
  if mesh is not None:
    split = lambda shape: NamedSharding(mesh, logical_to_spec(("batch", "length"), rules_from_config(cfg.mesh),  # noqa: E731
                                                              mesh, shape=shape))
    sharding = split((run_spec.update_rows, run_spec.update_row_len))
    samples_sharding = split((run_spec.batch_size, cfg.rl.max_prompt_len + cfg.rl.max_new_tokens))
  multiturn = rollout = partial = None
  if run_spec.multi_turn:
    if cfg.rl.max_staleness and jax.process_count() > 1:
      raise ValueError(f"rl.max_staleness={cfg.rl.max_staleness} with rl.multi_turn on {jax.process_count()} "
                       "processes: asynchronous episodes gather their environments' answers across hosts from a "
                       "second thread, whose collectives could interleave differently on each host; run "
                       "multi-turn RL synchronously (rl.max_staleness=0) on several hosts.")
    multiturn = episode_runner(cfg, mesh, tokenizer, env_work=env_work, model_numbers=run_spec.rollout_model)
    partial = PartialEpisodes(multiturn, cfg.rl.prompts_per_step) if cfg.rl.rollout_token_budget else None
  else:
    rollout = make_generator(cfg, mesh, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                             model_numbers=run_spec.rollout_model, spec=run_spec.generation)
    partial = PartialRollouts(rollout, cfg.rl.prompts_per_step) if cfg.rl.rollout_token_budget else None
  return RLRun(
      cfg=cfg, run_spec=run_spec, mesh=mesh, graphdef=graphdef, state=state,
      ref_params=jax.tree.map(jnp.copy, state.params) if spec.kl_metric else None,
      spec=spec, estimator=estimator,
      rollout=rollout,
      partial=partial,
      update=make_update(spec, graphdef, tx, batch_size=run_spec.update_rows,
                         num_minibatches=cfg.rl.num_minibatches, epochs=cfg.rl.epochs,
                         aux_free_bias=cfg.moe.aux_free_bias, bias_update_rate=cfg.moe.bias_update_rate),
      logprob_fn=make_logprob_fn(graphdef, temperature=cfg.rl.temperature,
                                 replay_routing=cfg.rl.replay_routing,
                                 logits_chunk=spec.logits_chunk, zigzag_inputs=spec.zigzag_inputs),
      advantages_fn=adv_lib.make_advantages(cfg, run_spec.estimator), tokenizer=tokenizer,
      pool=reward_pool(cfg, mesh, tokenizer,  # verifiers, and reward models / judges per domain
                       on_given_up=env_work.record if env_work is not None else None),
      env_work=env_work if env_work is not None else getattr(multiturn, "env_work", None),
      batch_sharding=sharding, samples_sharding=samples_sharding, zigzag_shards=zigzag_over,
      multiturn=multiturn, bootstrap=Bootstrap.from_config(cfg),
      replay=(SuccessReplay(capacity=cfg.rl.replay_groups, group_size=cfg.rl.group_size)
              if cfg.rl.replay_groups else None))


def _rollout_arrays(batch, keep_on_devices: bool = False) -> dict:
  """RolloutBatch (device) -> the host's dict of its fields; the routing stays on the devices (a
  RoutingRows of [B, L, S, K], rl/batches/routes.py) or is dropped.

  keep_on_devices: the per-token fields [B, S] stay where they are too, as rl/batches/rows.DeviceRows (the
  host moves samples by row; scoring pulls the response columns, `prepare` builds the update batch on
  the devices): no host ever holds the batch's tokens, [B, 1M] per field at a 1M-token context.
  The per-sample fields (lengths, truncated [B]) come to every host. False: everything to the host
  (`hosts.to_host`: every host's samples on every host)."""
  arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
  routing = arrays.pop("routing")
  arrays = rollout_rows(arrays) if keep_on_devices else jax.tree.map(hosts.to_host, arrays)
  if routing is not None:
    arrays["routing"] = RoutingRows.of_rollout(routing)
  return arrays


@dataclasses.dataclass
class InFlight:
  """A rollout dispatched ahead of the step that consumes it (asynchronous RL, rl.max_staleness)."""
  examples: list | None  # the task examples of its groups (None: partial rollouts not yet harvested)
  batch: Any  # RolloutBatch on the devices, possibly still being computed (host arrays once restored);
  #             multi-turn episodes: a Future of rl/step/episodes.MultiTurnRollout, run in a thread;
  #             partial rollouts: a harvest (rl/step/partial.PartialRollouts.dispatch) or, multi-turn, a
  #             Future of PartialEpisodes.step, until `settle`d
  version: int  # policy version of the parameters that generated it
  episodes: Any = None  # multi-turn: the episodes' stats and texts (JSON) once restored from a checkpoint
  info: dict | None = None  # partial rollouts: the step's groups admitted / ended / carried

  def settle(self) -> "InFlight":
    """Partial rollouts: waits for the dispatched step and keeps its ended groups (batch), their
    examples and info. Anything else is left as it is."""
    if self.examples is None:
      result = self.batch() if callable(self.batch) else self.batch.result()
      self.batch, self.examples, self.info = result
    return self

  def _value(self):
    batch = self.settle().batch
    return batch.result() if isinstance(batch, concurrent.futures.Future) else batch

  def arrays(self) -> dict:
    """The rollout's fields as `collect` uses them: per-token fields kept on the devices (host arrays
    once restored from a checkpoint)."""
    value = self._value()
    if isinstance(value, dict):
      return value
    if hasattr(value, "episodes"):  # multi-turn episodes
      return value.arrays
    return _rollout_arrays(value, keep_on_devices=True)

  def episodes_state(self) -> dict | None:
    """Multi-turn: {"stats": [...], "texts": [...]} of the episodes (waits for them); None otherwise."""
    if self.episodes is not None:
      return self.episodes
    value = self._value()
    if hasattr(value, "episodes"):
      return {"stats": [dataclasses.asdict(e) for e in value.episodes], "texts": list(value.texts)}
    return None


def in_flight_state(run: RLRun) -> list[dict]:
  """The rollouts in flight as JSON values, for the checkpoint (waits for them), so a resumed
  asynchronous run trains on exactly the rollouts the uninterrupted one would have. Each host holds
  only its own block of a rollout's examples (every host all of them with `shared_prompts`); the
  state has every host's, in process order (every process calls this: the gather is collective)."""
  def to_json(value):
    return array_to_json(value.to_host() if isinstance(value, DeviceRows) else value)
  shared = shared_prompts(run.cfg)
  return [{"examples": list(item.settle().examples) if shared else hosts.gather_objects(item.settle().examples),
           "version": item.version, "arrays": {name: to_json(value) for name, value in item.arrays().items()},
           **({"episodes": item.episodes_state()} if item.episodes_state() is not None else {}),
           **({"info": item.info} if item.info is not None else {})}
          for item in run.in_flight]


def restore_in_flight(run: RLRun, state: list[dict]) -> None:
  """Puts `in_flight_state`'s rollouts back in the queue (as host arrays), each host with its own
  block of their examples (`hosts.own_block`; all of them with `shared_prompts`)."""
  def from_json(name, value):
    array = array_from_json(value)
    return RoutingRows.from_host(array) if name == "routing" else array
  if not state:
    return
  shared = shared_prompts(run.cfg)
  run.in_flight = collections.deque(
      InFlight(item["examples"] if shared else item["examples"][hosts.own_block(len(item["examples"]))],
               {name: from_json(name, v) for name, v in item["arrays"].items()}, item["version"],
               episodes=item.get("episodes"), info=item.get("info"))
      for item in state)


def next_in_flight(run: RLRun, draw, key: jax.Array, start) -> tuple[InFlight, Any]:
  """Asynchronous RL: pops the oldest dispatched rollout, then tops the queue up to rl.max_staleness
  rollouts ahead -> (the popped InFlight, `start(popped)`'s result).

  `start(popped)` runs between the pop and the new dispatches: the step starts scoring the popped
  rollout there (responses pulled, verifiers queued on the host's threads, a reward model's or
  judge's calls dispatched to the devices), so the devices score batch k ahead of generating batch
  k + 1 while the host verifies; dispatched after the next rollout, any device work of the scoring
  (the responses' pull included) would wait for that whole rollout. New rollouts are dispatched with
  the current parameters and not waited for: JAX dispatch returns at once, so the devices generate
  them while the host scores the popped one (and the update that follows queues behind them). Each
  queued rollout waits max_staleness steps, so a rollout generated at version v is trained on at
  version v + max_staleness at most (v + step - 1 in the first steps).
  draw(count) -> (examples, tokens [count, Lp], mask) gives the prompts. With partial rollouts
  (run.partial) each dispatch is a budgeted step of the carried pool (PartialRollouts.dispatch), and
  the popped one is harvested when `start` reads it: the groups that ended in it (their slots are
  refilled by the dispatches that follow).
  """
  cfg = run.cfg.rl
  popped = 0

  def dispatch():
    # The n-th rollout of a step has key 1000 + n, n counting the one popped: as when the queue was
    # topped up to max_staleness + 1 before the pop.
    dispatch_key = jax.random.fold_in(key, 1000 + len(run.in_flight) + popped)
    if run.partial is not None:
      harvest = run.partial.dispatch(run.state.params, run.state.extra, draw, dispatch_key, run.version)
      run.in_flight.append(InFlight(None, harvest, run.version))
      return
    examples, tokens, mask = draw(cfg.prompts_per_step)
    batch = run.rollout(run.state.params, run.state.extra, tokens, mask, dispatch_key, None, run.version)
    run.in_flight.append(InFlight(examples, batch, run.version))

  if not run.in_flight:
    dispatch()
  oldest = run.in_flight.popleft()
  popped = 1
  started = start(oldest)
  while len(run.in_flight) < cfg.max_staleness:
    dispatch()
  return oldest, started


def score_own_block(arrays: dict, examples: list[dict], tokenizer: Tokenizer, pool: RewardPool, *,
                    examples_everywhere: bool = False, **kw) -> ScoredBatch:
  """`score_rollout` of the whole batch `arrays` ([B, ...] numpy, every host's groups side by side),
  where this host scores only its own groups and the scores are gathered from every host
  (sharding/hosts.py); with one process, plain `score_rollout`.

  Its own groups: the block of its own prompts (`examples` holds only those), or with
  `examples_everywhere` (partial rollouts: `examples` lists every group's, on every host) its
  `hosts.share` of the groups, as even as their count allows."""
  return start_own_block(arrays, examples, tokenizer, pool, examples_everywhere=examples_everywhere, **kw)()


def start_own_block(arrays: dict, examples: list[dict], tokenizer: Tokenizer, pool: RewardPool, *,
                    examples_everywhere: bool = False, **kw):
  """`score_own_block` in two halves (groups.start_scoring): the responses pulled and submitted to
  the pool -> `finish()`, which waits for the scores (and gathers every host's) -> ScoredBatch."""
  if not hosts.is_multihost():
    return start_scoring(arrays, examples, tokenizer, pool, **kw)
  group_size = kw["group_size"]
  groups = arrays["tokens"].shape[0] // group_size
  if examples_everywhere:
    mine = hosts.share(groups)
    examples = examples[mine]
  else:
    mine = hosts.own_block(groups)
  rows = slice(mine.start * group_size, mine.stop * group_size)
  # What scoring reads, the response columns, pulled by every host alike (for fields kept on the
  # devices the pull is collective), then this host's rows.
  responses = {**{k: v for k, v in arrays.items() if k in ("lengths", "truncated")},
               **response_columns(arrays, kw["max_new_tokens"])}
  own_arrays = {k: v[rows] for k, v in responses.items()}
  # rl.reward_norm="domain" whitens over the whole batch: after the gather, not within each host's block.
  whiten = isinstance(pool, SourcedRewards) and pool.normalize_domains
  own_finish = start_scoring(own_arrays, examples, tokenizer, pool, normalize=False if whiten else None, **kw) if (
      examples) else _nothing_to_score(own_arrays, pool)

  def finish() -> ScoredBatch:
    own = own_finish()
    info = gather_scoring_info(own.info, rows.start, rows.stop - rows.start)
    rewards, correct = hosts.gather_rows(own.rewards), hosts.gather_rows(own.correct)
    domains = hosts.gather_objects(own.domains)
    if whiten:  # the shaping (overlong penalty) kept on top, as with one process
      whitened = normalize_per_domain(correct, domains)
      rewards, correct = (rewards - correct + whitened).astype(np.float32), whitened
    return ScoredBatch(arrays=arrays, rewards=rewards, correct=correct,
                       sample_valid=hosts.gather_rows(own.sample_valid), domains=domains,
                       texts=hosts.gather_objects(own.texts), info=info)
  return finish


def _nothing_to_score(arrays: dict, pool: RewardPool):
  """A host with no groups of its own to score (an uneven share): it still submits an empty batch,
  since a reward model's or judge's calls span every host (rl/rewards/sources.py) -> finish()."""
  pending = pool.submit([], [])

  def finish() -> ScoredBatch:
    pool.collect(pending)
    return empty_scored(arrays)
  return finish


def _rows_sharding(sharding: NamedSharding | None) -> NamedSharding | None:
  """[rows, ...] split over the batch axes of `sharding` (the samples' [B, S]), every column whole."""
  if sharding is None:
    return None
  return NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0] if len(sharding.spec) else None))


def collect(run: RLRun, examples: Iterator[dict], key: jax.Array) -> tuple[ScoredBatch, dict]:
  """Rollout(s) and their scores for one step -> (ScoredBatch of exactly prompts_per_step groups,
  metrics). With rl.dynamic_sampling, up to rl.max_resample_rounds more rollouts refill the batch
  with groups whose rewards differ (DAPO); groups kept only for the shape have no gradient.
  With partial rollouts (run.partial) the batch is the groups that ended in this step's token
  budget, padded with sample_valid=False groups; unfinished groups carry over to the next step.
  With rl.max_staleness > 0 (asynchronous RL) the first round is the oldest rollout in flight
  (`next_in_flight`); refill rounds of dynamic sampling run at once with the current parameters.
  Every token carries the policy version that generated it; metrics report the staleness."""
  if run.multiturn is not None:  # tool episodes: generate, step the environments, extend the cache
    return collect_multiturn(run, examples, key)
  cfg = run.cfg.rl
  if run.bootstrap is not None:  # prompts at their curriculum levels, unsolved ones again (issue 33)
    examples = run.bootstrap.stream(examples)
  rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
  scored_rounds, rejected, truncated = [], 0, 0
  rollout_s = reward_s = 0.0
  generated, reward_errors, reward_timeouts = 0, 0, 0
  reward_env = {"reward_env_retries": 0, "reward_env_given_up": 0}  # verifiers' infrastructure failures
  first_errors = []
  partial_info = {}

  shared = shared_prompts(run.cfg)

  def draw(count):
    """This host's block of `count` prompts (its examples), and every host's tokens side by side (a
    global array of each host's own rows, `hosts.global_rows`). With `shared_prompts` every host
    draws the same `count` prompts (its stream is the whole stream)."""
    nonlocal rejected, truncated
    prompts = next_prompts(examples, run.tokenizer, count=count if shared else count // jax.process_count(),
                           max_len=cfg.max_prompt_len, overflow=cfg.prompt_overflow)
    if shared:
      rejected, truncated = rejected + prompts.rejected, truncated + prompts.truncated
      return prompts.examples, prompts.tokens, prompts.mask
    counts = hosts.gather_rows(np.asarray([[prompts.rejected, prompts.truncated]]))
    rejected, truncated = rejected + int(counts[:, 0].sum()), truncated + int(counts[:, 1].sum())
    rows = _rows_sharding(run.samples_sharding)
    return prompts.examples, hosts.global_rows(prompts.tokens, rows), hosts.global_rows(prompts.mask, rows)

  def begin(arrays, round_examples):
    """Starts scoring a round (start_own_block) -> finish() -> ScoredBatch."""
    if not round_examples:
      return lambda: empty_scored(arrays)
    return start_own_block(arrays, round_examples, run.tokenizer, run.pool, group_size=cfg.group_size,
                           max_new_tokens=cfg.max_new_tokens, overlong_buffer=cfg.overlong_buffer,
                           overlong_penalty_value=cfg.overlong_penalty, examples_everywhere=shared)

  for round_index in range(rounds):
    t0 = time.perf_counter()
    if round_index == 0 and cfg.max_staleness > 0:
      def start(item):  # the popped rollout's scoring starts before the next rollout is dispatched
        arrays = item.arrays()
        waited = time.perf_counter() - t0
        t1 = time.perf_counter()
        return arrays, begin(arrays, item.examples), waited, time.perf_counter() - t1
      dispatched, (arrays, finish, waited, starting) = next_in_flight(run, draw, key, start)
      rollout_s, reward_s = rollout_s + waited, reward_s + starting
      round_examples, partial_info = dispatched.examples, dict(dispatched.info or {})
    else:
      if run.partial is not None:
        arrays, round_examples, partial_info = run.partial.step(
            run.state.params, run.state.extra, draw, jax.random.fold_in(key, round_index), run.version)
      else:
        round_examples, tokens, mask = draw(cfg.prompts_per_step)
        t0 = time.perf_counter()
        arrays = _rollout_arrays(run.rollout(run.state.params, run.state.extra, tokens, mask,
                                             jax.random.fold_in(key, round_index), None, run.version),
                                 keep_on_devices=True)
      rollout_s += time.perf_counter() - t0
      t0 = time.perf_counter()
      finish = begin(arrays, round_examples)
      reward_s += time.perf_counter() - t0
    generated += int(arrays["lengths"].sum())
    t0 = time.perf_counter()
    scored = finish()
    reward_s += time.perf_counter() - t0
    if run.bootstrap is not None:
      run.bootstrap.observe(round_examples or [], scored)
    reward_errors += scored.info["reward_errors"]
    reward_timeouts += scored.info["reward_timeouts"]
    for name in reward_env:
      reward_env[name] += scored.info.get(name, 0)
    first_errors += scored.info["first_errors"]
    scored_rounds.append(scored)
    if enough_groups(scored_rounds, cfg):
      break
  if run.replay is not None:  # stored successes fill the places dynamic sampling left empty (issue 33)
    scored_rounds = with_replay(scored_rounds, run.replay, num_groups=cfg.prompts_per_step,
                                dynamic=cfg.dynamic_sampling)
    partial_info.update(run.replay.metrics())
  batch = step_groups(scored_rounds, cfg)
  partial_info.update(staleness(batch.arrays, run.version, run.samples_sharding))
  generator = run.partial if run.partial is not None else run.rollout
  if run.cfg.rl.speculative != "none" and generator.metrics is not None:  # the last rollout's
    spec = jax.device_get(generator.metrics)
    partial_info.update(spec_acceptance_rate=float(spec["acceptance_rate"]),
                        spec_tokens_per_forward=float(spec["tokens_per_forward"]))
  first = scored_rounds[0]  # the first round is an unbiased sample of the policy: report it
  if not first.texts:  # partial rollouts: no group ended in this step
    first = batch
  metrics = {
      **batch_metrics(first, batch, first.arrays["lengths"], cfg.group_size),
      "reward_errors": reward_errors, "reward_timeouts": reward_timeouts, **reward_env,
      "rollout_rounds": len(scored_rounds), "prompts_rejected": rejected, "prompts_truncated": truncated,
      "rollout_s": rollout_s, "reward_s": reward_s, "generated_tokens": generated,
  }
  if first_errors:
    metrics["first_reward_error"] = first_errors[0][:200]
  metrics.update(partial_info)
  if run.bootstrap is not None:
    metrics.update(run.bootstrap.metrics())
  return batch, metrics


def prepare(run: RLRun, scored: ScoredBatch) -> tuple[UpdateBatch, dict]:
  """ScoredBatch -> UpdateBatch on the devices, with everything `run.spec` needs, checked.

  Padded: one row per sample (zigzag for ring attention). Packed (rl.pack_updates): the valid
  samples' tokens packed into rl.packed_rows rows (rl/batches/packing.py); advantages are computed per
  sample and packed, reference log-probs and values are computed packed and unpacked for them.
  With rl.tis_level the rollout's log-probs become `behaviour_logprobs` and `old_logprobs` are
  recomputed under the current params (the proximal policy), unless the update is one minibatch of
  one epoch: its own forward then gives them (`LossSpec.proximal_in_update`; old_logprobs stays the
  behaviour's, unread by the loss), and the second forward over the batch is not run."""
  on_devices = isinstance(scored.arrays["tokens"], DeviceRows)
  aligned = align_on_devices(scored, run.samples_sharding) if on_devices else align_for_update(scored)
  routing = aligned.pop("routing", None) if run.spec.replay_routing else None
  aligned.pop("routing", None)
  if routing is not None and not isinstance(routing, RoutingRows):  # host routes [B, L, S, K]
    routing = RoutingRows.from_host(routing)
  plan, metrics = None, {}
  if run.spec.packed:
    spec = packing.PackingSpec.from_config(run.cfg, zigzag_shards=run.zigzag_shards,
                                           ladder=run.run_spec.update_row_ladder)
    spans = (packing.device_spans if on_devices else packing.trajectory_spans)(aligned["segment_ids"],
                                                                              scored.sample_valid)
    plan = packing.plan_from_spans(*spans, spec, num_columns=aligned["segment_ids"].shape[1])
    metrics.update(packing.packing_metrics(plan))
  layout = sample_layout(plan=plan, zigzag_shards=run.zigzag_shards, mesh=run.mesh,
                         batch_sharding=run.batch_sharding, samples_sharding=run.samples_sharding)
  if on_devices:  # the samples' rows never left the devices: laid out there (rl/batches/layouts.py)
    fields = layout.from_samples(aligned)
    if plan is not None:
      fields.update(packing.plan_ids(plan, run.batch_sharding))
    batch = UpdateBatch(**fields, advantages=_zeros_like(fields["old_logprobs"]))
  else:
    host = UpdateBatch(**aligned, advantages=np.zeros_like(aligned["old_logprobs"]))
    host = zigzag_batch(host, run.zigzag_shards) if plan is None else packing.pack_batch(host, plan)
    batch = device_put_batch(host, run.batch_sharding)
  if routing is not None:  # built on the devices, in the batch's layout (rl/batches/routes.py)
    batch = batch.replace(routing=routes.assemble(routing, run.batch_sharding, zigzag_shards=run.zigzag_shards,
                                                  plan=plan))
  ref_logprobs = values = None
  if run.ref_params is not None:
    ref_logprobs, _ = run.logprob_fn(run.ref_params, run.state.extra, batch)
  if run.spec.critic or (run.spec.tis_level != "none" and not run.spec.proximal_in_update):
    proximal, values = run.logprob_fn(run.state.params, run.state.extra, batch)
    if run.spec.tis_level != "none":
      batch = batch.replace(behaviour_logprobs=batch.old_logprobs, old_logprobs=proximal)
  elif run.spec.proximal_in_update:  # the update's forward is the proximal policy (losses.LossSpec)
    batch = batch.replace(behaviour_logprobs=batch.old_logprobs)
  advantages, returns, adv_metrics = _advantages_program(layout.to_program, layout.from_program, run.advantages_fn)(
      layout.cells, np.asarray(scored.rewards), np.asarray(scored.sample_valid),  # host vectors: jit's arguments
      (batch.loss_mask, batch.old_logprobs, ref_logprobs, values))
  batch = batch.replace(advantages=advantages, ref_logprobs=ref_logprobs,
                        old_values=values if run.spec.critic else None,
                        returns=returns if run.spec.critic else None)
  metrics.update(adv_metrics)  # jax scalars: rl_step fetches them with the update's metrics
  return batch.check(run.spec), metrics


_zeros_like = jax.jit(jnp.zeros_like)  # in the argument's sharding


@functools.lru_cache(maxsize=16)
def _advantages_program(to_samples, from_samples, advantages_fn):
  """One jitted program: the batch's (loss_mask, old_logprobs, ref_logprobs, values) to each sample in
  contiguous order ([B, S], the estimators' layout: GAE scans columns in order), the advantages and
  returns there, and back in the batch's layout (packed, or zigzag for ring attention); to_samples /
  from_samples: a SampleLayout's programs (rl/batches/layouts.py), advantages_fn: run.advantages_fn.
  (cells, rewards [B], valid [B], per-token fields) -> (advantages, returns, metrics), all on the
  devices: nothing of the batch's size goes through the host."""
  def program(cells, rewards, valid, fields):
    loss_mask, old_logprobs, ref_logprobs, values = to_samples(fields, *cells)
    advantages, returns, metrics = advantages_fn(rewards, loss_mask, valid, old_logprobs, ref_logprobs, values)
    return (*from_samples((advantages, returns), *cells), metrics)
  return jax.jit(program)


def fetch_metrics(tree):
  """`tree` (dicts of metrics) with every jax array among the values fetched in one transfer and made a
  Python float; other values as they are."""
  on_devices = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  fetched = iter(jax.device_get(on_devices))
  return jax.tree.map(lambda x: float(next(fetched)) if isinstance(x, jax.Array) else x, tree)


def rl_step(run: RLRun, examples: Iterator[dict], key: jax.Array) -> dict:
  """One RL step: collect -> score -> advantages -> update. Replaces `run.state`; returns metrics."""
  t0 = time.perf_counter()
  scored, metrics = collect(run, examples, jax.random.fold_in(key, 0))
  t_prepare = time.perf_counter()
  batch, prepare_metrics = prepare(run, scored)
  metrics.update(prepare_metrics)
  t_update = time.perf_counter()
  metrics["prepare_s"] = t_update - t_prepare
  run.state, update_metrics = run.update(run.state, batch, jax.random.fold_in(key, 1))
  run.version += 1
  update_metrics.pop("expert_load", None)
  # Metrics computed on the devices (staleness, advantages) come to the host here, in one transfer with
  # the update's, after the update is dispatched: none of them holds up the step's programs.
  update_metrics, metrics = fetch_metrics((update_metrics, metrics))
  # The metrics are read from one device; the others may still be finishing their shards of the new
  # state (on 2 simulated CPU devices up to 0.1 s), which the next rollout would otherwise be timed for.
  jax.block_until_ready(run.state)
  metrics["update_s"] = time.perf_counter() - t_update
  metrics.update(update_metrics)
  metrics.setdefault("kl", 0.0)
  metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
  metrics["time_s"] = time.perf_counter() - t0
  metrics["tokens_per_s"] = np.prod(scored.arrays["tokens"].shape) / metrics["time_s"]
  return metrics
