"""The KV cache's host tier (rl.kv_host_bytes, issue 34 part 3; rl/generation/tiers.py): a paused
slot's row moved to host memory and back gives identical next-token logits (model-dtype and int8
KV, a sharded mesh); the byte budget keeps a row that does not fit on the device; episodes whose
paused rows were parked are the episodes without a tier, token for token; a host tier larger than
host memory names the field."""

import concurrent.futures
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from meshrl import configs
from meshrl.configs import checks
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.generation.episodic import EpisodicScheduler
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.generation.tiers import HostTier
from meshrl.rl.step.spec import make_generator
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=12", "model.max_seq_len=32",
         "model.init_std=0.5", "rl.temperature=0.0", "rl.group_size=2", "rl.engine=continuous",
         "rl.decode_slots=2", "rl.max_turn_tokens=3", "rl.max_obs_tokens=4"]
TEXTS = ["1+2=", "rev abcd=", "sort 9 1 5="]


@functools.cache
def _setup(kv: str):
  cfg = configs.load("configs/tiny.py", SMALL + [f"rl.kv_cache_dtype={kv}"])
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  _, state = create_train_state(model, make_optimizer(cfg.optim), mesh)
  gen = make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, multi_turn=True)
  return gen, state


def _prompts():
  tokens, mask = TOK.encode_batch(TEXTS, length=8, padding="left")
  return jnp.asarray(tokens), jnp.asarray(mask)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _decoded_slots(gen, state, engine):
  """Two slots holding samples 0 and 1 after a turn of 3 tokens (both paused), slots of 4."""
  weights = (gen.prepare(state.params), state.extra, None)
  tokens, mask = _prompts()
  pool = gen.new_pool(tokens, mask, sample_keys(jax.random.key(1), jnp.arange(6)))
  rows = engine.prefill(weights, tokens, mask)
  slots = engine.empty(weights, 6, rows[2].shape[-1])
  take = np.full(4, 4, np.int32)
  sid = np.full(4, 6, np.int32)
  take[:2], sid[:2] = [0, 1], [0, 3]
  slots, pool = engine.admit(weights, slots, pool, rows, jnp.asarray(take), jnp.asarray(sid))
  slots, pool, _ = engine.decode(weights, slots, pool, jnp.int32(0), steps=3)
  assert np.asarray(pool.paused)[[0, 3]].all()
  return weights, slots, pool


@pytest.mark.parametrize("kv", ["model", pytest.param("int8", marks=pytest.mark.slow)])  # int8: suite budget
def test_a_parked_and_restored_row_gives_identical_logits(kv, devices):
  """Sample 3's slot (1) parked in the host tier (memory kind pinned_host: its arrays live there),
  the slot freed, the row restored into slot 3: its cache row (entries, int8 scales, positions,
  segments, index), logits and position equal slot 1's before, and after the same observation is fed
  into both, their next-token logits are identical. Catches a row restored into the wrong slot, a
  dropped int8 scale, logits or position left behind, a row copied at the wrong columns."""
  del devices
  gen, state = _setup(kv)
  engine = gen.slot_engine(num_slots=4)
  weights, slots, pool = _decoded_slots(gen, state, engine)
  kept_slots, kept_pool = _copy(slots), _copy(pool)
  tier = HostTier(10 ** 9)
  slots, moved = tier.park(slots, 1, 3, pool.num_samples)
  assert moved and int(slots.sid[1]) == 6 and tier.holds(3) and tier.used == tier.row_bytes(slots)
  kinds = {a.sharding.memory_kind for a in jax.tree.leaves(tier.parked[3].row)}
  assert kinds == {"pinned_host"}, kinds
  if kv == "int8":
    assert any(a.dtype == jnp.int8 for a in jax.tree.leaves(tier.parked[3].row["cache"].layers))
  slots = tier.restore(slots, 3, 3)
  assert not tier.holds(3) and tier.used == 0 and int(slots.sid[3]) == 3
  kept_row = kvc.take_rows(kept_slots.cache, jnp.asarray([1]))
  restored_row = kvc.take_rows(slots.cache, jnp.asarray([3]))
  for a, b in zip(jax.tree.leaves(kept_row), jax.tree.leaves(restored_row)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(kept_slots.logits[1]), np.asarray(slots.logits[3]))
  assert int(kept_slots.position[1]) == int(slots.position[3])
  observation = jnp.asarray([[70, 71, 72, 0]], jnp.int32)
  paused_logits = np.asarray(kept_slots.logits[1])
  before, _ = engine.observe(weights, kept_slots, kept_pool, jnp.asarray([1], jnp.int32), observation,
                             jnp.asarray([3], jnp.int32))
  after, _ = engine.observe(weights, slots, pool, jnp.asarray([3], jnp.int32), observation, jnp.asarray([3], jnp.int32))
  np.testing.assert_array_equal(np.asarray(before.logits[1]), np.asarray(after.logits[3]))
  assert not np.array_equal(np.asarray(before.logits[1]), paused_logits)  # the observation counted


def test_the_host_budget_keeps_a_row_that_does_not_fit_on_the_device(devices):
  """A budget of one row and a half: the first paused row moves, the second stays in its slot (sid
  kept, refused counted), the bytes held never pass the budget; a budget below one row moves none.
  Catches a budget not checked, or checked after the move."""
  del devices
  gen, state = _setup("model")
  engine = gen.slot_engine(num_slots=4)
  _, slots, pool = _decoded_slots(gen, state, engine)
  row = HostTier.row_bytes(slots)
  assert HostTier.device_bytes(slots) == 4 * row
  tier = HostTier(row + row // 2)
  slots, first = tier.park(slots, 0, 0, pool.num_samples)
  slots, second = tier.park(slots, 1, 3, pool.num_samples)
  assert first and not second and int(slots.sid[1]) == 3 and tier.used == row <= tier.budget
  assert tier.stats.parked == 1 and tier.stats.refused == 1
  small = HostTier(row - 1)
  slots, moved = small.park(slots, 1, 3, pool.num_samples)
  assert not moved and int(slots.sid[1]) == 3 and small.used == 0


def test_episodes_with_parked_rows_are_the_episodes_without(devices):
  """6 episodes of 2 turns (3 tokens each, 1-3 observation tokens between) on 2 slots whose
  environments answer after 30-90 ms: with a host tier, paused
  episodes give their slots to waiting ones (rows parked and restored), and every episode's tokens,
  masks and log-probs equal the run without a tier. Catches a restored row that is not the parked
  one (the episode would continue differently), an answer fed to the wrong slot, a lost episode."""
  del devices
  gen, state = _setup("model")
  tokens, mask = _prompts()
  weights = (gen.prepare(state.params), state.extra, None)
  pools = {}
  tiers = {}
  with concurrent.futures.ThreadPoolExecutor(6) as workers:
    def respond(turn):
      def answer():
        time.sleep(0.03 * (1 + turn.sample % 3))
        return None if turn.generated >= 6 else [60 + turn.sample, 61, 62][:1 + turn.sample % 3]  # 2 turns fit
      return workers.submit(answer)
    engine = gen.slot_engine(num_slots=2)  # one set of compiled programs for both runs
    for budget in (0, 10 ** 9):
      scheduler = EpisodicScheduler(engine, chunk_steps=2, barrier=False, max_obs_tokens=4, turn_width=3,
                                    host_bytes=budget)
      pool = gen.new_pool(tokens, mask, sample_keys(jax.random.key(2), jnp.arange(6)))
      pools[budget], stats = scheduler.run(weights, pool, tokens, mask, respond, version=0)
      tiers[budget] = stats.tier
  assert tiers[0] is None and tiers[10 ** 9].parked >= 2 and tiers[10 ** 9].restored >= 2, tiers
  plain, tiered = pools[0], pools[10 ** 9]
  assert np.asarray(plain.done).all() and np.asarray(tiered.done).all()
  for field in ("tokens", "count", "generated", "policy"):
    np.testing.assert_array_equal(np.asarray(getattr(plain, field)), np.asarray(getattr(tiered, field)), err_msg=field)
  np.testing.assert_allclose(np.asarray(plain.logprobs), np.asarray(tiered.logprobs), atol=1e-5)


def test_a_host_tier_larger_than_host_memory_names_the_field():
  """rl.kv_host_bytes above the host's memory (or negative, or fractional) is refused by the config
  check, the generation spec and the tier, naming the field; the host's own size passes."""
  memory = 1 << 20
  for bad in (memory + 1, -1, 2.5):
    with pytest.raises(ValueError, match="rl.kv_host_bytes"):
      checks.check_kv_memory(ml_collections.ConfigDict({"rl": {"prefill_chunk": 0, "kv_host_bytes": bad}}),
                             host_memory_bytes=memory)
    with pytest.raises(ValueError, match="rl.kv_host_bytes"):
      HostTier(bad, host_memory=memory)
  checks.check_kv_memory(ml_collections.ConfigDict({"rl": {"prefill_chunk": 0, "kv_host_bytes": memory}}),
                         host_memory_bytes=memory)
  assert HostTier(memory, host_memory=memory).budget == memory
  spec = make_generator(configs.load("configs/tiny.py", SMALL), None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id).spec
  with pytest.raises(ValueError, match="rl.kv_host_bytes"):
    dataclasses.replace(spec, kv_host_bytes=1 << 62)
