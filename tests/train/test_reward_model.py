"""The reward model: its loss and accuracy against a numpy Bradley-Terry computation, scores read at
each row's last token, scoring on the 8-device mesh equal to one device, training that raises
held-out pairwise accuracy, and the saved checkpoint loaded back as a policy's reward model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import load_tokenizer
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.envs.mixture import TaskMixture
from meshrl.rl.rewards import answer_reward
from meshrl.sharding import make_mesh
from meshrl.sharding.rules import rules_from_config
from meshrl.train.preferences import encode_pairs
from meshrl.train.reward_model import (PairBatch, RMLossSpec, bradley_terry_loss, chosen_lm_loss, make_scorer,
                                       pairwise_accuracy, rm_loss, score_pairs, score_rows)
from meshrl.train.rm_source import load_reward_model
from meshrl.train.rm_training import batch_indices, run_reward_model
from meshrl.train.synthetic_pairs import synthetic_pairs


def _np_bradley_terry(chosen, rejected, margins):
  """The reference: mean of -log(1 / (1 + exp(-(c - r - m)))) in float64, and the share c > r."""
  gap = chosen.astype(np.float64) - rejected - margins
  return float(np.mean(np.log1p(np.exp(-gap)))), float(np.mean(chosen > rejected))


def _cfg(**overrides):
  cfg = configs.load("configs/tiny_rm.py")
  with cfg.unlocked():
    cfg.model.update(value_head=True, num_layers=2, embed_dim=64, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128)
    cfg.moe.update(num_experts=4, expert_mlp_dim=64, first_k_dense=1)
    for key, value in overrides.items():
      section, name = key.split(".")
      cfg[section][name] = value
  return cfg


def test_loss_and_accuracy_equal_numpy_bradley_terry():
  rng = np.random.default_rng(0)
  chosen, rejected = rng.normal(size=64).astype(np.float32), rng.normal(size=64).astype(np.float32)
  rejected[:5] = chosen[:5]  # ties count as wrong
  margins = rng.uniform(0, 2, size=64).astype(np.float32)
  want_loss, want_acc = _np_bradley_terry(chosen, rejected, margins)
  assert float(bradley_terry_loss(chosen, rejected, margins)) == pytest.approx(want_loss, rel=1e-5)
  assert float(pairwise_accuracy(chosen, rejected)) == pytest.approx(want_acc)
  # A margin must raise the loss (its sign): the gap has to clear it.
  assert float(bradley_terry_loss(chosen, rejected, margins)) > float(bradley_terry_loss(chosen, rejected, 0 * margins))


def _pairs_batch(tokenizer, max_len=24):
  pairs = synthetic_pairs(TaskMixture("reverse:1.0", seed=3).take(8), seed=3,
                          is_correct=lambda text, ex: answer_reward(text, ex) >= 1.0)
  pairs = [p._replace(margin=0.25 * i) for i, p in enumerate(pairs)]
  return encode_pairs(pairs, tokenizer, max_len=max_len)


def test_rm_loss_on_a_model_equals_numpy_on_its_scores():
  """rm_loss's Bradley-Terry term equals the numpy reference on the model's own scores, with margin =
  the row's margin + rm.margin (a dropped or flipped margin, or swapped sides, fails)."""
  cfg = _cfg(**{"rm.margin": 0.5})
  model = build_model(ModelConfig.from_config(cfg))
  arrays = _pairs_batch(load_tokenizer())
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  batch = PairBatch(*(jnp.asarray(a) for a in arrays))
  loss, metrics = rm_loss(params, extra, graphdef, batch, spec=RMLossSpec.from_config(cfg))
  chosen = np.asarray(score_rows(model, batch.chosen, batch.chosen_lengths)[0])
  rejected = np.asarray(score_rows(model, batch.rejected, batch.rejected_lengths)[0])
  want_loss, want_acc = _np_bradley_terry(chosen, rejected, arrays.margins + 0.5)
  assert float(metrics["bt_loss"]) == pytest.approx(want_loss, rel=1e-5)
  assert float(metrics["accuracy"]) == pytest.approx(want_acc)
  aux = cfg.moe.aux_loss_coef * metrics["moe_aux_loss"] + cfg.moe.z_loss_coef * metrics["moe_z_loss"]
  assert float(loss) == pytest.approx(want_loss + float(aux), rel=1e-5)


def test_score_is_the_value_at_each_rows_last_token():
  """The score is values[b, length - 1]; tokens after it (padding) do not change it."""
  cfg = _cfg()
  model = build_model(ModelConfig.from_config(cfg))
  tokens = np.random.default_rng(0).integers(0, 256, (3, 12)).astype(np.int32)
  lengths = np.array([12, 5, 1], np.int32)
  scores, _ = score_rows(model, tokens, lengths)
  values = np.asarray(model(tokens, return_hidden=True).values)
  np.testing.assert_allclose(np.asarray(scores), values[np.arange(3), lengths - 1], rtol=1e-6)
  other = tokens.copy()
  other[np.arange(12)[None, :] >= lengths[:, None]] = 7
  np.testing.assert_allclose(np.asarray(score_rows(model, other, lengths)[0]), np.asarray(scores), atol=1e-5)


def test_scoring_on_the_mesh_equals_one_device(devices):
  """Scores of a model sharded over 8 devices (fsdp=2 x expert=2 x tensor=2, rows on the batch axes)
  equal the same parameters' scores on one device."""
  del devices
  cfg = _cfg(**{"mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 2})
  mesh = make_mesh(cfg.mesh)
  rules = rules_from_config(cfg.mesh)
  sharded = build_model(ModelConfig.from_config(cfg, mesh), mesh, rules=rules)
  graphdef, params, extra = nnx.split(sharded, nnx.Param, ...)
  assert len(sharded.moe_stack.mlp.gate[...].addressable_shards) == 8
  arrays = _pairs_batch(load_tokenizer())
  on_mesh = score_pairs(make_scorer(graphdef, mesh, rules), params, extra, arrays, batch_size=8, mesh=mesh,
                        rules=rules)
  single_graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(ModelConfig.from_config(cfg),
                                                                       rngs=nnx.Rngs(0))), nnx.Param, ...)
  host = jax.device_get((params, extra))
  one = score_pairs(make_scorer(single_graphdef), *host, arrays, batch_size=8)
  for side_mesh, side_one in zip(on_mesh, one):
    assert np.abs(side_one).max() > 1e-3  # a real score, not an all-zero head
    np.testing.assert_allclose(side_mesh, side_one, atol=1e-5, rtol=1e-5)


def test_batch_indices_visit_every_pair_once_per_epoch():
  draws = np.concatenate([batch_indices(10, 4, step, seed=1) for step in range(1, 6)])  # 20 = 2 epochs
  assert sorted(draws[:10]) == list(range(10)) and sorted(draws[10:]) == list(range(10))
  assert not np.array_equal(draws[:10], draws[10:])
  np.testing.assert_array_equal(batch_indices(10, 4, 3, seed=1), draws[8:12])  # a resumed step draws the same


def _synthetic(split, seed, count):
  mixture = TaskMixture("reverse:1.0", seed=seed, split=split, eval_fraction=0.2)
  return synthetic_pairs(mixture.take(count), seed=seed,
                         is_correct=lambda text, ex: answer_reward(text, ex) >= 1.0)


def test_training_raises_held_out_pairwise_accuracy(tmp_path, devices):
  """A small model trained on 1,024 synthetic reverse pairs (2 devices, fsdp=2) ranks held-out pairs
  well above chance; the checkpoint it writes loads back as a policy's reward model and scores as
  the trained state does."""
  del devices
  cfg = _cfg(**{"mesh.fsdp": 2, "rm.steps": 120, "rm.eval_every": 60, "rm.learning_rate": 1e-3,
                "log.progress_bar": False, "log.tensorboard": False, "log.plot": False,
                "checkpoint.async_save": False, "log.profile_start": 120, "log.profile_steps": 1})
  mesh = make_mesh(cfg.mesh, devices=jax.devices()[:2])
  tokenizer = load_tokenizer()
  train = encode_pairs(_synthetic("train", 0, 1024), tokenizer, max_len=cfg.rm.max_len)
  held_out = encode_pairs(_synthetic("eval", 7919, 256), tokenizer, max_len=cfg.rm.max_len)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, rules=rules_from_config(cfg.mesh))
  result = run_reward_model(cfg, str(tmp_path), mesh, model, train=train, held_out=held_out)
  accuracy = [r["eval/pairwise_accuracy"] for r in result.history if "eval/pairwise_accuracy" in r]
  print(f"held-out pairwise accuracy: {accuracy}")
  assert abs(accuracy[0] - 0.5) < 0.1  # an untrained head ranks at chance
  assert accuracy[-1] >= 0.65 and accuracy[-1] > accuracy[0] + 0.15
  profile = json.loads((tmp_path / "profile" / "summary.json").read_text())  # the last step, not its evaluation
  assert profile["steps"] == [120, 120] and [p["program"] for p in profile["programs"]][:1] == ["jit_rm_step"]
  assert {p["program"]: p["calls"] for p in profile["programs"]}["jit_rm_step"] == 1

  loaded, rm_cfg = load_reward_model(str(tmp_path), cfg, mesh)
  assert rm_cfg.model.value_head
  graphdef, params, extra = nnx.split(loaded, nnx.Param, ...)
  rules = rules_from_config(cfg.mesh)
  scores = score_pairs(make_scorer(graphdef, mesh, rules), params, extra, held_out, batch_size=32, mesh=mesh,
                       rules=rules)
  assert float(np.mean(scores[0] > scores[1])) == pytest.approx(accuracy[-1])


def test_the_language_modelling_term_is_next_token_cross_entropy_over_real_tokens():
  """chosen_lm_loss against numpy (a shifted target, the padding counted, a row's last token used as
  an input with no target: each fails it), and rm_loss adds rm.lm_coef times it to Bradley-Terry."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 6, 11)).astype(np.float32)
  tokens = rng.integers(0, 11, size=(3, 6)).astype(np.int32)
  lengths = np.asarray([6, 3, 1], np.int32)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  terms = [-logp[b, t, tokens[b, t + 1]] for b in range(3) for t in range(lengths[b] - 1)]
  np.testing.assert_allclose(float(chosen_lm_loss(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(lengths))),
                             np.mean(terms), rtol=1e-5)
  cfg = _cfg()
  model = build_model(ModelConfig.from_config(cfg), None, seed=0)
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  arrays = encode_pairs(synthetic_pairs(TaskMixture("reverse:1.0", seed=3).take(4), seed=3,
                                        is_correct=lambda t, e: answer_reward(t, e) >= 1.0), load_tokenizer(), max_len=16)
  batch = PairBatch(jnp.asarray(arrays.chosen), jnp.asarray(arrays.chosen_lengths), jnp.asarray(arrays.rejected),
                    jnp.asarray(arrays.rejected_lengths), jnp.asarray(arrays.margins))
  _, plain = rm_loss(params, extra, graphdef, batch, spec=RMLossSpec())
  _, with_lm = rm_loss(params, extra, graphdef, batch, spec=RMLossSpec(lm_coef=0.5))
  out = model(batch.chosen)
  lm = float(chosen_lm_loss(out.logits, batch.chosen, batch.chosen_lengths))
  assert lm > 1.0 and float(with_lm["lm_loss"]) == pytest.approx(lm, rel=1e-5)
  assert float(with_lm["loss"]) == pytest.approx(float(plain["loss"]) + 0.5 * lm, rel=1e-5)
  assert float(with_lm["bt_loss"]) == pytest.approx(float(plain["bt_loss"]), rel=1e-5)
