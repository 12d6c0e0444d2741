"""The continuous-batching engine (rl/engine.py): same samples as the static rollout under per-sample
keys, clean slot refills, partial rollouts carried across steps with per-segment versions, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl import loop
from meshrl.rl.engine import check_engine_config, make_engine
from meshrl.rl.partial import PartialRollouts
from meshrl.rl.rollout import make_rollout
from meshrl.rl.sampling import Sampler
from meshrl.rl.step import rl_step
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
PROMPT_LEN, NEW = 8, 6
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW}",
         "model.max_seq_len=16", "model.init_std=0.5"]
# Prompts of different lengths, so a slot's previous occupant would be visible if its row survived.
TEXTS = ["1+2=", "rev abcd=", "x", "sort 9 1 5="]
FIELDS = ("tokens", "positions", "segment_ids", "prompt_mask", "response_mask", "lengths", "truncated",
          "policy_version")


def _setup(*extra, on_mesh=False):
  """Without a mesh unless `on_mesh` (the engine's sharded path is run by test_rl_step_runs_on_the_engine):
  a one-device program compiles several times faster."""
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  mesh = make_mesh(cfg.mesh) if on_mesh else None
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, state = create_train_state(model, make_optimizer(cfg.optim), mesh)
  return cfg, mesh, graphdef, state


def _assert_same_samples(a, b):
  for field in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field)
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4)
  np.testing.assert_array_equal(np.asarray(a.routing), np.asarray(b.routing))


# Stop tokens this model (seeded init) samples often, so samples end at many different steps.
STOPS = "rl.stop_tokens=173,247"
LIMITS = np.array([6, 1, 3, 6, 2, 5, 4, 6, 6, 2, 1, 5], np.int32)  # per-sample length limits


def _static_reference(cfg, state, key):
  tokens, mask = TOK.encode_batch(TEXTS, length=PROMPT_LEN, padding="left")
  static = make_rollout(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)(
      state.params, state.extra, tokens, mask, key, LIMITS, 3)
  return tokens, mask, static


def test_engine_gives_the_static_samples_with_refills_and_groups():
  """4 prompts x G=3 = 12 samples on 5 slots (7 refills), stop tokens and per-sample length limits:
  every field (tokens, masks, positions, log-probs, routing, versions) equals the static rollout's."""
  cfg, _, _, state = _setup("rl.group_size=3", STOPS)
  key = jax.random.key(7)
  tokens, mask, static = _static_reference(cfg, state, key)
  engine = make_engine(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, slots=5)
  out = engine(state.params, state.extra, tokens, mask, key, LIMITS, 3)
  _assert_same_samples(static, out)
  lengths, stopped = np.asarray(out.lengths), ~np.asarray(out.truncated)
  assert len(set(lengths.tolist())) >= 4 and stopped.sum() >= 3 and (lengths == LIMITS).sum() >= 3
  assert (np.asarray(out.policy_version)[np.asarray(out.response_mask)] == 3).all()


def test_unrolled_decode_gives_the_scanned_samples_in_both_loops():
  """model.decode_layers=unrolled (per-layer weights and caches taken once per decode loop; `auto`'s
  choice on CPU) gives every field of the scanned blocks' samples, in the static rollout and in the
  engine, and its rollout program scans the blocks in the prefill only; `auto` picks it on CPU and
  the scan for a TPU mesh."""
  key = jax.random.key(7)
  outs, scans = {}, {}
  for mode in ("scan", "unrolled"):
    cfg, _, _, state = _setup("rl.group_size=3", STOPS, f"model.decode_layers={mode}")
    tokens, mask, static = _static_reference(cfg, state, key)
    engine = make_engine(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, slots=5)
    outs[mode] = (static, engine(state.params, state.extra, tokens, mask, key, LIMITS, 3))
    rollout = make_rollout(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
    scans[mode] = str(jax.make_jaxpr(rollout)(state.params, state.extra, tokens, mask, key)).count("scan[")
  for scanned, unrolled in zip(*outs.values()):
    _assert_same_samples(scanned, unrolled)
  assert scans["scan"] - scans["unrolled"] == 2, scans  # the decode step's dense and MoE stacks
  assert ModelConfig.from_config(cfg, None).unrolled_decode == (jax.default_backend() == "cpu")
  with pytest.raises(ValueError, match="model.decode_layers='sometimes'"):
    ModelConfig.from_config(configs.load("configs/tiny.py", ["model.decode_layers=sometimes"]), None)
  pytest.importorskip("libtpu", reason="a TPU mesh needs libtpu (the tpu extra)")
  from meshrl.rl import aot  # pylint: disable=import-outside-toplevel
  auto = configs.load("configs/tiny.py", ["mesh.fsdp=4"])
  assert not ModelConfig.from_config(auto, aot.topology_mesh(auto, aot.topology_devices("v5e:2x2"))
                                     ).unrolled_decode


@pytest.mark.slow
def test_engine_without_prefix_sharing_and_on_a_mesh_gives_the_static_samples(devices):
  """The same samples with every sample prefilled on its own (prompts repeated, G=1) on 4 slots,
  and with prefix sharing on the 8-device mesh (fsdp=4 x tensor=2, 4 slots: sharded cache rows)."""
  cfg, _, _, state = _setup("rl.group_size=3", STOPS)
  key = jax.random.key(7)
  tokens, mask, static = _static_reference(cfg, state, key)
  unshared = make_engine(cfg, None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, slots=4, group_size=1)
  out = unshared(state.params, state.extra, np.repeat(tokens, 3, 0), np.repeat(mask, 3, 0), key, LIMITS, 3)
  _assert_same_samples(static, out)
  cfg, mesh, _, state = _setup("rl.group_size=3", STOPS, "mesh.fsdp=4", "mesh.tensor=2", on_mesh=True)
  static = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)(
      state.params, state.extra, tokens, mask, key, LIMITS, 3)
  out = make_engine(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, slots=4)(
      state.params, state.extra, tokens, mask, key, LIMITS, 3)
  _assert_same_samples(static, out)


def test_slot_refill_replaces_the_whole_cache_row():
  """copy_rows puts the source row in whole (entries, positions, segments, index): nothing of the
  slot's previous occupant (written past the new prompt) survives, and untouched slots stay."""
  shapes = {"dense": {"k": (2, 2, 4), "v": (2, 2, 4)}}
  src = kvc.with_row_index(kvc.init_cache(shapes, 2, 10))
  src = src.replace(layers=jax.tree.map(lambda a: a.at[:, :, :3].set(1.0), src.layers),
                    positions=src.positions.at[:, :3].set(jnp.arange(3)),
                    segment_ids=src.segment_ids.at[:, :3].set(1), index=jnp.full((2,), 3, jnp.int32))
  old = kvc.with_row_index(kvc.init_cache(shapes, 3, 10))
  old = old.replace(layers=jax.tree.map(lambda a: a + 7.0, old.layers), positions=old.positions * 0 + 5,
                    segment_ids=old.segment_ids * 0 + 1, index=jnp.full((3,), 9, jnp.int32))
  new = kvc.copy_rows(old, src, jnp.asarray([1, 0, 0]), jnp.asarray([True, False, True]))
  for row, source in ((0, 1), (2, 0)):
    for got, want in ((new.positions, src.positions), (new.segment_ids, src.segment_ids),
                      (new.index, src.index), (new.layers["dense"]["k"][:, row], src.layers["dense"]["k"][:, source])):
      np.testing.assert_array_equal(np.asarray(got if got.ndim == 3 else got[row]),
                                    np.asarray(want if want.ndim == 3 else want[source]))
  assert (np.asarray(new.positions[row, 3:]) == kvc.EMPTY_POSITION).all()
  np.testing.assert_array_equal(np.asarray(new.positions[1]), np.asarray(old.positions[1]))
  np.testing.assert_array_equal(np.asarray(new.layers["dense"]["v"][:, 1]), np.asarray(old.layers["dense"]["v"][:, 1]))
  assert int(new.index[1]) == 9


def _draw_from(texts):
  counter = iter(range(1000))

  def draw(count):
    ids = [next(counter) for _ in range(count)]
    tokens, mask = TOK.encode_batch([texts[i % len(texts)] for i in ids], length=PROMPT_LEN, padding="left")
    return ids, tokens, mask
  return draw


def _perturbed(params, version):
  return jax.tree.map(lambda p: p * (1.0 + 0.05 * version), params)


def test_partial_rollouts_carry_masks_positions_logprobs_and_versions():
  """3 groups of 2 on 4 slots, 2 decode steps per RL step, params changed after every step: each
  ended sample's masks and positions are those of one rollout, each token's log-prob equals a fresh
  forward of the finished sequence under the params of the version recorded for it, and samples
  that ran across steps carry several versions."""
  cfg, mesh, graphdef, state = _setup(
      "rl.group_size=2", "rl.prompts_per_step=3", "rl.engine=continuous", "rl.decode_slots=4",
      "rl.rollout_token_budget=8", "rl.max_resample_rounds=0")
  partial = PartialRollouts(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  draw, key = _draw_from(TEXTS), jax.random.key(3)
  ended = []
  for version in range(5):
    arrays, examples, info = partial.step(_perturbed(state.params, version), state.extra, draw,
                                          jax.random.fold_in(key, version), version)
    assert info["groups_ended"] == len(examples) and arrays["tokens"].shape[0] == 2 * len(examples)
    assert info["groups_ended"] + info["groups_carried"] == 3
    ended += [{k: v[i] for k, v in arrays.items()} for i in range(arrays["tokens"].shape[0])]
  assert len(ended) >= 4
  sampler = Sampler(cfg.rl.temperature)
  forward = jax.jit(lambda params, t, p, s: nnx.merge(graphdef, params, state.extra)(
      t[None], positions=p[None], segment_ids=s[None]).logits[0])
  multi = 0
  for sample in ended:
    response = sample["response_mask"]
    length = int(sample["lengths"])
    assert response[PROMPT_LEN:PROMPT_LEN + length].all() and response.sum() == length
    assert not sample["prompt_mask"][PROMPT_LEN:].any() and not response[:PROMPT_LEN].any()
    prompt_len = int(sample["prompt_mask"].sum())
    np.testing.assert_array_equal(sample["positions"][PROMPT_LEN:PROMPT_LEN + length],
                                  prompt_len + np.arange(length))
    versions = sample["policy_version"][PROMPT_LEN:PROMPT_LEN + length]
    assert (np.diff(versions) >= 0).all() and (sample["policy_version"][~response] == -1).all()
    multi += len(set(versions.tolist())) > 1
    for version in sorted(set(versions.tolist())):
      logits = forward(_perturbed(state.params, version), sample["tokens"], sample["positions"],
                       sample["segment_ids"])
      columns = PROMPT_LEN + np.flatnonzero(versions == version)
      want = sampler.log_probs(logits[columns - 1], jnp.asarray(sample["tokens"][columns]))
      np.testing.assert_allclose(sample["logprobs"][columns], np.asarray(want), atol=2e-4)
  assert multi >= 2  # segments under different params really happened


@pytest.mark.slow
def test_partial_rollouts_with_unchanged_params_give_the_static_samples():
  """Carrying (re-prefilling prompt + generated-so-far) loses nothing: with the params unchanged
  across steps, the first step's groups end as the static rollout drew them, even when the carried
  state goes through the checkpoint's JSON (get_state -> set_state on a new instance) mid-way."""
  cfg, mesh, _, state = _setup("rl.group_size=2", "rl.prompts_per_step=3", "rl.engine=continuous",
                               "rl.decode_slots=2", "rl.rollout_token_budget=4", "rl.max_resample_rounds=0")
  partial = PartialRollouts(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  draw, key = _draw_from(TEXTS[:3]), jax.random.key(5)
  rows = {}
  for step in range(12):
    if step == 2:
      saved = json.loads(json.dumps(partial.get_state()))
      partial = PartialRollouts(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
      partial.set_state(saved)
    arrays, examples, _ = partial.step(state.params, state.extra, draw, jax.random.fold_in(key, step), step)
    for i, example in enumerate(examples):
      rows[example] = {k: v[2 * i:2 * i + 2] for k, v in arrays.items()}
    if all(e in rows for e in range(3)):
      break
  tokens, mask = TOK.encode_batch(TEXTS[:3], length=PROMPT_LEN, padding="left")
  static = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)(
      state.params, state.extra, tokens, mask, jax.random.fold_in(key, 0))
  for example in range(3):
    group = slice(2 * example, 2 * example + 2)
    for field in FIELDS[:-1]:
      np.testing.assert_array_equal(rows[example][field], np.asarray(getattr(static, field))[group])
    np.testing.assert_allclose(rows[example]["logprobs"], np.asarray(static.logprobs)[group], atol=1e-5)
  assert any(len(set(r["policy_version"][r["response_mask"]].tolist())) > 1 for r in rows.values())


def test_bad_engine_settings_name_their_fields():
  def cfg(*extra):
    return configs.load("configs/tiny.py", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_resample_rounds=0",
                                            *extra])
  with pytest.raises(ValueError, match="rl.engine='paged'"):
    check_engine_config(cfg("rl.engine=paged").rl)
  with pytest.raises(ValueError, match="rl.rollout_token_budget=7 is less than one token per decode slot"):
    check_engine_config(cfg("rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=7").rl)
  with pytest.raises(ValueError, match="rl.rollout_token_budget=15 is less than one token per decode slot"):
    check_engine_config(cfg("rl.engine=continuous", "rl.rollout_token_budget=15").rl)  # 16 slots
  with pytest.raises(ValueError, match="need rl.engine='continuous'"):
    check_engine_config(cfg("rl.decode_slots=4").rl)
  with pytest.raises(ValueError, match="rl.max_resample_rounds=0"):
    check_engine_config(cfg("rl.engine=continuous", "rl.rollout_token_budget=64", "rl.max_resample_rounds=2").rl)
  with pytest.raises(ValueError, match="rl.decode_slots=-1"):
    check_engine_config(cfg("rl.engine=continuous", "rl.decode_slots=-1").rl)
  check_engine_config(cfg("rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=8").rl, 8)
  # Through the run's own check: 6 slots over data*fsdp*expert = 8 (the default mesh on 8 devices).
  with pytest.raises(ValueError, match=r"rl.decode_slots=6 \(6 slots\) is not divisible by the data-parallel"):
    loop.check_config(cfg("rl.engine=continuous", "rl.decode_slots=6", "rl.sft_steps=0"), num_devices=8)
  with pytest.raises(ValueError, match="rl.rollout_token_budget=3"):
    loop.check_config(cfg("rl.engine=continuous", "rl.decode_slots=4", "rl.rollout_token_budget=3"))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["rl.engine=continuous", "rl.decode_slots=8"],
    ["rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=16", "rl.dynamic_sampling=false"],
])
def test_rl_step_runs_on_the_engine(extra, devices):
  """The run's own step program with the continuous engine, and with partial rollouts: a batch of
  the fixed shape, finite metrics, carried groups reported."""
  cfg = configs.load("configs/tiny.py", ["rl.sft_steps=0", "rl.prompts_per_step=4", "rl.group_size=4",
                                         "rl.num_minibatches=1", "rl.max_new_tokens=8", *extra])
  run, prompts = loop.setup(cfg)
  for step in range(3):
    metrics = rl_step(run, prompts, jax.random.key(step))
    assert np.isfinite(metrics["loss"]), metrics
  if cfg.rl.rollout_token_budget:
    assert metrics["groups_ended"] + metrics["groups_carried"] == 4
  run.close()
