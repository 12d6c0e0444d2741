"""Multi-turn episodes compose with every option of the generation core and of the RL step: the
continuous (episodic) scheduler, speculative decoding, the int8 KV cache and weights, the gathered
layout, MoE routing replay over every token, packed updates, asynchronous RL and partial episodes
carried across steps, each asserting its effect."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.step import driver as loop
from meshrl.rl.step import program as step_lib
from meshrl.rl.envs.file_tasks import copy_task
from meshrl.rl.batches.rows import DeviceRows
from meshrl.rl.generation import host
from meshrl.rl.step.spec import episode_runner
from meshrl.train.metrics import CompileCounter

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.mlp_dim=64", "moe.expert_mlp_dim=32", "moe.first_k_dense=1",
         "rl.max_prompt_len=24", "rl.max_new_tokens=48", "model.max_seq_len=88", "rl.max_obs_tokens=16",
         "model.init_std=0.3", "rl.multi_turn=true", "rl.max_turn_tokens=12", "rl.max_turns=3", "rl.group_size=2",
         "rl.prompts_per_step=4", "rl.env_workers=2", "rl.sft_steps=0", "rl.num_minibatches=1",
         "data.tasks=files_copy:1.0", "rl.max_resample_rounds=0", "rl.dynamic_sampling=false", "eval.every=0"]


def _examples(seed=0):
  rng = np.random.default_rng(seed)
  return itertools.cycle([{**copy_task(rng, 1), "verifier": "files", "domain": "files_copy"} for _ in range(8)])


def _host(arrays):
  return {k: v.to_host() if isinstance(v, DeviceRows) else v for k, v in arrays.items() if k != "routing"}


def _rollout(cfg, state, key=1):
  runner = episode_runner(cfg, None, TOK)
  try:
    return runner, runner.rollout(state.params, state.extra, [next(_examples()) for _ in range(4)],
                                  jax.random.key(key), version=2)
  finally:
    runner.close()


def test_routes_of_every_token_are_replayed_exactly(devices):
  """An MoE policy's multi-turn batch, built by the run's own collect and prepare: the update's log-
  probs recomputed with the replayed routes equal the behaviour log-probs within 1e-4 on every policy
  token of every turn; routes taken away from the observation tokens (expert 0 there) break it, so
  the observations' routes were recorded and replayed."""
  del devices
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.temperature=1.0", "moe.first_k_dense=0"])  # 2 MoE layers: layer 0's routes reach later tokens
  run, _ = loop.setup(cfg)
  scored, _ = step_lib.collect(run, _examples(), jax.random.key(3))
  batch, _ = step_lib.prepare(run, scored)
  logp, _ = run.logprob_fn(run.state.params, run.state.extra, batch)
  mask = np.asarray(batch.loss_mask)
  assert mask.sum() > 20
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(batch.old_logprobs)[mask], atol=1e-4)
  host = _host(scored.arrays)
  observation = (host["segment_ids"] > 0) & ~host["response_mask"] & ~host["prompt_mask"]
  assert observation.any()
  # observation[b, s] is input column s: the routes of that token (axis 2 of [B, L, S, K]) go to 0.
  wiped = batch.replace(routing=jnp.where(jnp.asarray(observation)[:, None, :, None], 0, batch.routing))
  logp_wiped, _ = run.logprob_fn(run.state.params, run.state.extra, wiped)
  after = mask & np.cumsum(observation, axis=1).astype(bool)  # policy tokens after an observation
  assert np.abs(np.asarray(logp_wiped) - np.asarray(batch.old_logprobs))[after].max() > 1e-3
  run.close()


def test_generation_options_reach_episodes(monkeypatch):
  """The episodic scheduler (4 slots for 8 episodes) and n-gram speculation give the turn-synchronous
  rollout's episodes token for token; the int8 KV cache decodes them on int8 cache rows; int8
  weights are made for the episodes' generator. The episodic scheduler reads paused turns in row
  buckets (one compile per bucket, not per count of paused samples: a compile in mid-run each step
  otherwise) and counts the decode steps of all its calls."""
  asked_rows, read_tokens = [], host.read_tokens

  def counted(tokens, sid, end, width):
    asked_rows.append(len(sid))
    return read_tokens(tokens, sid, end, width)
  monkeypatch.setattr(host, "read_tokens", counted)
  base = configs.load("configs/tiny.py", SMALL + ["rl.temperature=0.7"])
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  from meshrl.model.transformer import ModelConfig  # pylint: disable=import-outside-toplevel
  from meshrl.train.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  from meshrl.train.state import create_train_state  # pylint: disable=import-outside-toplevel
  _, state = create_train_state(build_model(ModelConfig.from_config(base, None), None), make_optimizer(base.optim),
                                None)
  _, want = _rollout(base, state)
  want_arrays = _host(want.arrays)
  for extra in (["rl.engine=continuous", "rl.decode_slots=4"],
                ["rl.engine=continuous", "rl.speculative=ngram", "rl.speculative_k=3", "rl.ngram_n=1"]):
    runner, got = _rollout(configs.load("configs/tiny.py", SMALL + ["rl.temperature=0.7"] + extra),
                           state)
    got_arrays = _host(got.arrays)
    for name in ("tokens", "response_mask", "positions", "policy_version"):
      np.testing.assert_array_equal(got_arrays[name], want_arrays[name], err_msg=f"{extra} {name}")
    np.testing.assert_allclose(got_arrays["logprobs"], want_arrays["logprobs"], atol=1e-4)
    if "rl.speculative=ngram" in extra:
      assert got.counts["tokens_per_forward"] >= 1.0
    else:  # plain decoding: a sample's tokens took a target forward each, over several decode calls
      assert got.counts["target_forwards"] >= max(e.policy_tokens for e in got.episodes) > 8  # 8: one call's steps
      assert asked_rows and set(asked_rows) <= set(host.buckets(8)), asked_rows
  int8 = configs.load("configs/tiny.py", SMALL + ["rl.kv_cache_dtype=int8", "rl.generation_weights=int8",
                                                  "rl.tis_level=token"])
  runner, out = _rollout(int8, state)
  engine = runner.scheduler(4).engine
  cache = engine.empty(runner.weights(state.params, state.extra), 4, TOK.vocab_size).cache
  assert {str(a.dtype) for a in jax.tree.leaves(cache.layers) if a.ndim >= 3} >= {"int8"}
  assert any(a.dtype == jnp.int8 for a in jax.tree.leaves(runner.generator.prepare(state.params)))
  assert sum(e.policy_tokens for e in out.episodes) > 0


def _partial_episodes_run():
  """(cfg, run, draw) of partial episodes (a 96-token budget per step over 8 decode slots);
  draw(count) -> the next `count` examples."""
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.engine=continuous", "rl.decode_slots=8",
                                                 "rl.rollout_token_budget=96"])
  run, _ = loop.setup(cfg)
  examples = _examples()
  return cfg, run, lambda count: [next(examples) for _ in range(count)]


def test_partial_episodes_hand_over_routes_the_carried_pool_does_not_hold(devices):
  """Partial episodes with routing replay: the routes of a step's ended episodes are a copy of their
  rows, not the carried pool's routing buffer, which the next step's programs donate (under
  asynchronous RL in the episodes' thread while the update still reads the routes: a segfault in CI).
  Fails if the harvest hands the pool's own buffer over (the routes then read as deleted, or change)."""
  del devices
  cfg, run, draw = _partial_episodes_run()
  with CompileCounter() as compiles:
    for version in range(6):  # until a step ends some group
      out, _, info = run.partial.step(run.state.params, run.state.extra, draw, jax.random.key(version), version)
      if info["groups_ended"]:
        break
  # fresh slots and counters come in the layout the decode call returns, and the budget's shorter last chunk
  # runs the same program: it compiles once, not per layout or per chunk length
  assert version >= 1 and compiles.count("_decode") == 1, dict(compiles.by_function)
  routes = out.arrays["routing"]
  pool_routes = np.asarray(run.partial.pool.routing)
  ended = [s for s in routes.sources]
  assert all(source is not run.partial.pool.routing for source in ended)
  rows = np.asarray(routes.rows)
  mine = np.concatenate([np.asarray(source) for source in ended], axis=1)[:, rows]  # [L, E*G, S, K]
  chosen = np.flatnonzero(~run.partial.live.repeat(cfg.rl.group_size))  # the ended groups' pool rows
  np.testing.assert_array_equal(mine, pool_routes[:, chosen[:len(rows)]])
  run.partial.step(run.state.params, run.state.extra, draw, jax.random.key(9), version + 1)  # donates the pool
  assert not any(source.is_deleted() for source in ended)
  np.testing.assert_array_equal(np.concatenate([np.asarray(s) for s in ended], axis=1)[:, rows], mine)
  run.close()


def test_partial_episodes_in_a_checkpoint_restart_from_their_prompts(devices):
  """A checkpoint taken while partial episodes are still running holds their examples (JSON: an
  environment cannot be saved), and the resumed run admits exactly those groups first, drawing new
  tasks only for the slots left. Fails if the carried state raises (PartialEpisodes had no
  get_state), drops the running groups, or restarts them after new draws."""
  import json  # pylint: disable=import-outside-toplevel
  del devices
  cfg, run, draw = _partial_episodes_run()
  run.partial.step(run.state.params, run.state.extra, draw, jax.random.key(0), 0)
  running = [run.partial.examples[g] for g in np.flatnonzero(run.partial.live)]
  assert running, "the budget should leave some group running after one step"
  state = json.loads(json.dumps(loop.carried_state(run)))
  run.close()
  assert state["partial"]["restart"] == running

  resumed, _ = loop.setup(cfg)
  loop.restore_carried_state(resumed, state)
  fresh = _examples(seed=1)
  drawn = []
  def draw_fresh(count):
    drawn.append(count)
    return [next(fresh) for _ in range(count)]
  resumed.partial.step(resumed.state.params, resumed.state.extra, draw_fresh, jax.random.key(1), 1)
  resumed.close()
  assert sum(drawn) == cfg.rl.prompts_per_step - len(running)
  assert resumed.partial.examples[:len(running)] == running


@pytest.mark.parametrize("extra,check", [
    # async and partial alone run with the slow tests (74 s together): async_partial below turns both on
    # and asserts each one's effect (a step in flight after every step; groups carried, staleness >= 1).
    pytest.param(["rl.max_staleness=1", "rl.tis_level=token"], "async", marks=pytest.mark.slow),
    pytest.param(["rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=96"], "partial",
                 marks=pytest.mark.slow),
    (["rl.pack_updates=true"], "packed"),
    (["rl.max_staleness=1", "rl.tis_level=token", "rl.engine=continuous", "rl.decode_slots=8",
      "rl.rollout_token_budget=96"], "async_partial"),
])
def test_rl_steps_on_episodes_compose(extra, check, devices):
  """RL steps of multi-turn episodes with asynchronous RL (episodes of batch k+1 run in a thread while
  batch k updates: staleness 1 from the second step), partial episodes (a budget of 96 tokens per
  step: groups are carried with their environments, several policy versions in a finished episode),
  both at once (the next step's partial episodes run ahead in the thread while a step updates) and
  packed updates (finite losses on packed rows)."""
  del devices
  cfg = configs.load("configs/tiny.py", SMALL + extra)
  run, _ = loop.setup(cfg)
  examples = _examples()
  records, in_flight = [], []
  for i in range(3):
    records.append(step_lib.rl_step(run, examples, jax.random.key(i)))
    in_flight.append(len(run.in_flight))
  run.close()
  for record in records:
    assert np.isfinite(record["loss"]) or record.get("updated_minibatches", 1) == 0, record
  if check == "async":
    assert [r["staleness_max"] for r in records[1:]] == [1.0, 1.0]
  elif check in ("partial", "async_partial"):
    assert in_flight == ([1, 1, 1] if check == "async_partial" else [0, 0, 0])  # a step dispatched ahead
    assert sum(r["groups_carried"] for r in records) > 0
    assert any(r["groups_ended"] > 0 for r in records)
    assert max(r["staleness_max"] for r in records) >= 1.0  # a finished episode spans several versions
  else:
    assert records[-1]["generated_tokens"] > 0
