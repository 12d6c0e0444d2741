"""The jitted update on real rollouts: on-policy agreement with the rollout (routing replay), the
loss terms against an independent numpy computation, shardings kept, bad batches refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.algo import losses
from meshrl.rl.batches.handover import ScoredBatch, UpdateBatch
from meshrl.rl.step.program import _rollout_arrays, build_run, prepare
from meshrl.rl.algo.update import make_update, rl_loss
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "moe.first_k_dense=0", "rl.max_prompt_len=8", "rl.max_new_tokens=8",
         "model.max_seq_len=16", "rl.prompts_per_step=4", "rl.group_size=4", "optim.learning_rate=3e-3",
         "rl.dynamic_sampling=false"]
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8="]


def _run(extra=(), mesh_overrides=("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")):
  cfg = configs.load("configs/tiny.py", SMALL + list(mesh_overrides) + list(extra))
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0)
  return cfg, build_run(cfg, mesh, model, TOK)


def _scored(run, seed=0) -> ScoredBatch:
  tokens, mask = TOK.encode_batch(PROMPTS, length=run.cfg.rl.max_prompt_len)
  out = run.rollout(run.state.params, run.state.extra, tokens, mask, jax.random.key(seed))
  arrays = _rollout_arrays(out)
  rewards = np.random.RandomState(seed).rand(16).astype(np.float32)
  return ScoredBatch(arrays=arrays, rewards=rewards, correct=rewards, sample_valid=np.ones(16, bool),
                     domains=["arithmetic"] * 16, texts=[""] * 16)


def test_recomputed_logprobs_equal_behaviour_logprobs_with_routing_replay(devices):
  """Temperature 0.7, every layer MoE: the update's log-probs equal the rollout's within 1e-4, the first
  minibatch is on-policy (ratio 1, nothing clipped); foreign routes change the log-probs."""
  _, run = _run(["rl.temperature=0.7", "rl.num_minibatches=2", "rl.kl_coef=0.1"])
  batch, _ = prepare(run, _scored(run))
  # A batch lacking what a loss term needs is refused by name, before the update runs.
  with pytest.raises(ValueError, match=r"lacks \['ref_logprobs'\].*KL k3"):
    batch.replace(ref_logprobs=None).check(run.spec)
  with pytest.raises(ValueError, match="lacks.*routing"):
    batch.replace(routing=None).check(run.spec)
  with pytest.raises(ValueError, match="advantages has shape"):
    batch.replace(advantages=batch.advantages[:, :3]).check(run.spec)
  with pytest.raises(ValueError, match="old_values"):
    UpdateBatch.check(batch, dataclasses.replace(run.spec, value_coef=0.5))
  logp, _ = run.logprob_fn(run.state.params, run.state.extra, batch)
  mask = np.asarray(batch.loss_mask)
  assert mask.sum() > 20
  diff = np.abs(np.asarray(logp) - np.asarray(batch.old_logprobs))[mask]
  assert diff.max() < 1e-4, diff.max()
  # Replaying other experts' routes changes what the update computes.
  foreign = batch.replace(routing=(batch.routing + 1) % run.cfg.moe.num_experts)
  logp_foreign, _ = run.logprob_fn(run.state.params, run.state.extra, foreign)
  assert np.abs(np.asarray(logp_foreign) - np.asarray(logp))[mask].max() > 1e-3
  state, metrics = run.update(run.state, batch, jax.random.key(1))
  assert abs(float(metrics["ratio_mean_first"]) - 1.0) < 1e-4
  assert float(metrics["clip_frac_first"]) == 0.0
  assert float(metrics["logprob_diff_max_first"]) < 1e-4
  assert 0.0 <= float(metrics["route_mismatch"]) <= 1.0
  assert float(metrics["moe_dropped_frac"]) == 0.0  # exact dispatch: nothing dropped, and it is reported
  del state


def test_update_lowers_loss_and_keeps_shardings(devices):
  cfg, run = _run(["rl.num_minibatches=2", "rl.epochs=2", "rl.policy_loss=gspo"])
  batch, _ = prepare(run, _scored(run))
  shardings = [x.sharding for x in jax.tree.leaves(run.state.params)]

  def loss_of(state):
    return float(rl_loss(state.params, state.extra, run.graphdef, batch, run.spec)[0])
  before = loss_of(run.state)
  state = run.state
  for i in range(5):
    state, metrics = run.update(state, batch, jax.random.key(i))
  assert loss_of(state) < before - 0.05
  assert np.isfinite(float(metrics["grad_norm"]))
  for want, x in zip(shardings, jax.tree.leaves(state.params)):
    assert x.sharding.is_equivalent_to(want, x.ndim)  # the next rollout takes them in place
  del cfg


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_rl_loss_terms_equal_independent_numpy(devices):
  """Policy (PPO clip), entropy bonus, KL k3 in the loss and the clipped value loss, summed with
  their coefficients, equal a numpy computation from the model's own logits and values."""
  cfg, run = _run(["rl.entropy_coef=0.01", "rl.kl_coef=0.2", "rl.kl_estimator=k3", "rl.advantage=gae",
                   "model.value_head=true", "rl.value_coef=0.5", "rl.value_clip=0.1",
                   "moe.aux_loss_coef=0", "moe.z_loss_coef=0"], mesh_overrides=())
  assert run.spec.critic and run.spec.kl_coef == 0.2
  batch, _ = prepare(run, _scored(run))
  rng = np.random.RandomState(3)
  # Perturb the stored quantities so every term is away from its trivial value.
  batch = batch.replace(old_logprobs=batch.old_logprobs + jnp.asarray(rng.normal(0, 0.3, batch.tokens.shape),
                                                                    jnp.float32),
                        ref_logprobs=batch.ref_logprobs + 0.5,
                        old_values=batch.old_values + 0.3)
  loss, metrics = rl_loss(run.state.params, run.state.extra, run.graphdef, batch, run.spec)
  model = jax.tree.map(lambda x: x, run.state)
  from flax import nnx  # pylint: disable=import-outside-toplevel
  out = nnx.merge(run.graphdef, model.params, model.extra)(
      batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids,
      routing=jnp.swapaxes(batch.routing, 0, 1))
  logits = np.asarray(out.logits, np.float64) / cfg.rl.temperature
  values = np.asarray(out.values, np.float64)
  b = jax.tree.map(lambda x: np.asarray(x, np.float64) if x is not None else None, batch)
  mask = b.loss_mask.astype(bool)
  logp_all = _log_softmax(logits)
  logp = np.take_along_axis(logp_all, b.targets[..., None].astype(int), -1)[..., 0]
  ratio = np.exp(logp - b.old_logprobs)
  adv = b.advantages
  pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - cfg.rl.clip_low, 1 + cfg.rl.clip_high))
  entropy = -(np.exp(logp_all) * logp_all).sum(-1)
  d = b.ref_logprobs - logp
  k3 = np.exp(d) - d - 1
  clipped_v = b.old_values + np.clip(values - b.old_values, -0.1, 0.1)
  vf = 0.5 * np.maximum((values - b.returns) ** 2, (clipped_v - b.returns) ** 2)
  mean = lambda x: x[mask].mean()  # noqa: E731  token_mean
  want = mean(pg) - 0.01 * mean(entropy) + 0.2 * mean(k3) + 0.5 * mean(vf)
  np.testing.assert_allclose(float(loss), want, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(float(metrics["kl"]), mean(k3), rtol=2e-4)
  np.testing.assert_allclose(float(metrics["entropy"]), mean(entropy), rtol=2e-4)


def test_minibatches_must_divide_batch():
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.num_minibatches=3"])
  spec = losses.LossSpec.from_config(cfg, needs_critic=False)
  with pytest.raises(ValueError, match="rl.num_minibatches=3 must divide the batch of 16"):
    make_update(spec, None, make_optimizer(cfg.optim), batch_size=16, num_minibatches=3)


# --- chunked log-probs and truncated importance weights, on one prepared batch --------------------

TIS_CHUNK = ["rl.tis_level=token", "rl.tis_cap=2.0", "rl.entropy_coef=0.01", "rl.kl_coef=0.2",
             "rl.temperature=0.7", "moe.aux_loss_coef=0", "moe.z_loss_coef=0",
             "rl.num_minibatches=2"]  # two minibatches: the proximal log-probs are recomputed in prepare


@pytest.fixture(scope="module")
def tis_case(devices):  # pylint: disable=unused-argument
  """(run, scored, prepared batch, loss_and_grad(spec, batch)) with token-level TIS, KL and entropy."""
  _, run = _run(TIS_CHUNK, mesh_overrides=())
  scored = _scored(run)
  batch, _ = prepare(run, scored)
  compiled = {}

  def loss_and_grad(spec, batch):
    if spec not in compiled:
      compiled[spec] = jax.jit(jax.value_and_grad(
          lambda params, b: rl_loss(params, run.state.extra, run.graphdef, b, spec), has_aux=True))
    return compiled[spec](run.state.params, batch)
  return run, scored, batch, loss_and_grad


def test_empty_and_non_finite_minibatches_leave_the_state_unchanged(tis_case):
  """A minibatch without loss tokens (all groups dropped by dynamic sampling: only the MoE balance
  loss has a gradient, which Adam would turn into full-size router steps) and one with a planted NaN
  (the NaN guard) leave parameters and optimizer state bit-identical, and are counted; a real batch
  still moves them. (On the TIS / KL / entropy run below: its programs are compiled once for both.)"""
  run, _, batch, _ = tis_case
  before = jax.tree.map(np.asarray, (run.state.params, run.state.opt_state))
  state = jax.tree.map(jnp.copy, run.state)  # the update donates its state: the fixture's stays
  empty = batch.replace(loss_mask=np.zeros_like(np.asarray(batch.loss_mask)))
  poisoned = batch.replace(old_logprobs=batch.old_logprobs * np.nan)  # every minibatch
  for bad, counter in ((empty, "skipped_minibatches"), (poisoned, "nonfinite_minibatches")):
    state, metrics = run.update(state, bad, jax.random.key(0))
    assert float(metrics[counter]) == 1.0, counter
    assert float(metrics["updated_minibatches"]) == 0.0
    # Nothing was measured: NaN, which rl/step/driver.without_unmeasured leaves out of the record (an
    # entropy of 0 had been reported for such a step).
    for name in ("loss", "entropy", "grad_norm", "ratio_mean_first"):
      assert np.isnan(float(metrics[name])), name
    for want, got in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
      np.testing.assert_array_equal(np.asarray(got), want)
  state, metrics = run.update(state, batch, jax.random.key(0))
  assert float(metrics["skipped_minibatches"]) == 0.0 and float(metrics["nonfinite_minibatches"]) == 0.0
  assert float(metrics["updated_minibatches"]) == 1.0 and np.isfinite(float(metrics["entropy"]))
  moved = [np.abs(np.asarray(g) - w).max() for w, g in zip(jax.tree.leaves(before[0]),
                                                           jax.tree.leaves(state.params))]
  assert max(moved) > 0


@pytest.mark.slow  # chunked_token_stats against dense, gradients included: tests/train/test_chunked_loss.py
def test_chunked_logprobs_entropy_kl_equal_dense_with_gradients(tis_case):
  """attention.logits_chunk=5 (columns 16, so the last chunk is padded): the RL loss (TIS-weighted
  policy, entropy bonus, KL k3 in the loss), its metrics and its gradient equal the dense path's."""
  run, _, batch, loss_and_grad = tis_case
  rng = np.random.RandomState(0)
  batch = batch.replace(old_logprobs=batch.old_logprobs + jnp.asarray(rng.normal(0, 0.3, batch.tokens.shape),
                                                                    jnp.float32),
                        ref_logprobs=batch.ref_logprobs + 0.5)
  (dense, dense_metrics), dense_grads = loss_and_grad(run.spec, batch)
  (chunked, chunked_metrics), chunked_grads = loss_and_grad(dataclasses.replace(run.spec, logits_chunk=5), batch)
  # The loss is a sum of terms that nearly cancel (1.7e-4 here, from much larger parts): its float32 rounding
  # is relative to the parts, not to the sum, so the tolerance is too (each part is held to 1e-5 below).
  parts = max(abs(float(dense_metrics[name])) for name in ("pg_loss", "entropy", "kl"))
  np.testing.assert_allclose(float(chunked), float(dense), rtol=1e-5, atol=1e-5 * parts)
  for name in ("pg_loss", "entropy", "kl", "ratio_mean", "tis_weight_mean"):
    np.testing.assert_allclose(float(chunked_metrics[name]), float(dense_metrics[name]), rtol=1e-5, err_msg=name)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(dense_grads))
  for want, got in zip(jax.tree.leaves(dense_grads), jax.tree.leaves(chunked_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * scale)


def test_importance_weights_follow_the_behaviour_policy(tis_case):
  """prepare keeps the rollout's log-probs as behaviour_logprobs and recomputes old_logprobs (equal
  within numerics: the policy did not change); the policy loss is weighted by exactly 1 when old ==
  behaviour, by the cap when old - behaviour = 1 (e > 2), by e^-1 when it is -1; the update reports
  the mean weight and the truncated fraction."""
  run, scored, batch, loss_and_grad = tis_case
  from meshrl.rl.batches.handover import align_for_update  # pylint: disable=import-outside-toplevel
  np.testing.assert_array_equal(np.asarray(batch.behaviour_logprobs), align_for_update(scored)["old_logprobs"])
  mask = np.asarray(batch.loss_mask)
  assert np.abs(np.asarray(batch.old_logprobs) - np.asarray(batch.behaviour_logprobs))[mask].max() < 1e-4
  with pytest.raises(ValueError, match=r"lacks \['behaviour_logprobs'\]"):
    batch.replace(behaviour_logprobs=None).check(run.spec)
  pg = {}
  lifted = batch.replace(advantages=batch.advantages + jnp.where(batch.loss_mask, 1.0, 0.0))  # pg away from 0
  for name, shift in (("same", 0.0), ("capped", -1.0), ("down", 1.0)):
    (_, metrics), _ = loss_and_grad(run.spec, lifted.replace(behaviour_logprobs=batch.old_logprobs + shift))
    pg[name] = float(metrics["pg_loss"])
    if name == "same":
      assert float(metrics["tis_weight_mean"]) == 1.0 and float(metrics["tis_truncated_frac"]) == 0.0
    if name == "capped":
      assert float(metrics["tis_weight_mean"]) == pytest.approx(2.0)
      assert float(metrics["tis_truncated_frac"]) == 1.0
  assert abs(pg["same"]) > 1e-3
  assert pg["capped"] == pytest.approx(2.0 * pg["same"], rel=1e-5)
  assert pg["down"] == pytest.approx(np.exp(-1.0) * pg["same"], rel=1e-5)
  state, metrics = run.update(run.state, batch, jax.random.key(0))
  run.state = state
  assert float(metrics["tis_weight_mean"]) == pytest.approx(1.0, abs=1e-3)
  assert float(metrics["tis_truncated_frac"]) == 0.0


def test_one_minibatch_takes_the_proximal_policy_from_the_update_forward(devices):  # pylint: disable=unused-argument
  """Token TIS over one minibatch of one epoch (LossSpec.proximal_in_update): prepare runs no second
  forward, and the loss, its TIS weights and its gradient equal those with old_logprobs recomputed by
  that forward, on behaviour log-probs one update old (noise of 0.3). With two minibatches, a critic
  or the KL in the reward the recomputation stays."""
  _, run = _run(["rl.tis_level=token", "rl.temperature=0.7", "rl.clip_low=0.1", "rl.clip_high=0.1",
                 "rl.num_minibatches=1"], mesh_overrides=())
  assert run.spec.proximal_in_update and run.ref_params is None
  calls = []
  logprob_fn = run.logprob_fn
  run.logprob_fn = lambda *a: calls.append(1) or logprob_fn(*a)
  scored = _scored(run)
  stale = np.asarray(scored.arrays["logprobs"]) + np.random.RandomState(1).normal(
      0, 0.3, np.shape(scored.arrays["logprobs"])).astype(np.float32)
  scored.arrays["logprobs"] = np.where(np.asarray(scored.arrays["response_mask"]) != 0, stale, 0.0).astype(np.float32)
  batch, _ = prepare(run, scored)
  assert not calls  # no proximal forward
  recomputed = batch.replace(old_logprobs=logprob_fn(run.state.params, run.state.extra, batch)[0])
  explicit = dataclasses.replace(run.spec, proximal_in_update=False)
  grad_of = lambda spec: jax.jit(jax.value_and_grad(  # noqa: E731  (one program per spec, any batch)
      lambda p, b: rl_loss(p, run.state.extra, run.graphdef, b, spec), has_aux=True))
  (loss, metrics), grads = grad_of(run.spec)(run.state.params, batch)
  explicit_grad = grad_of(explicit)
  (want, want_metrics), want_grads = explicit_grad(run.state.params, recomputed)
  assert 0.05 < float(want_metrics["tis_truncated_frac"]) or float(want_metrics["tis_weight_mean"]) != 1.0
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  for name in ("tis_weight_mean", "tis_truncated_frac", "pg_loss", "ratio_mean"):
    np.testing.assert_allclose(float(metrics[name]), float(want_metrics[name]), rtol=1e-5, atol=1e-6, err_msg=name)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
  for got, exp in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=1e-4 * scale)
  # The old policy taken as the behaviour one (no recomputation at all) is a different loss.
  (behaviour_loss, _), _ = explicit_grad(run.state.params, batch)
  assert abs(float(behaviour_loss) - float(want)) > 1e-4
  cfg = run.cfg
  for overrides, want_flag in ((["rl.num_minibatches=2"], False), (["rl.epochs=2"], False),
                               (["rl.kl_coef=0.1", "rl.kl_in_reward=true"], False), ([], True)):
    spec = losses.LossSpec.from_config(configs.load(
        "configs/tiny.py", SMALL + ["rl.tis_level=token", "rl.num_minibatches=1"] + overrides), needs_critic=False)
    assert spec.proximal_in_update is want_flag, overrides
  assert not losses.LossSpec.from_config(cfg, needs_critic=True).proximal_in_update


def test_update_metrics_average_the_applied_minibatches_only():
  """2 epochs x 2 minibatches, the second of each empty (dynamic sampling dropped its groups): its
  zeros must not halve the entropy; with none applied there is no value, and the step's record
  leaves the key out (rl/step/driver.without_unmeasured)."""
  from meshrl.rl.step.driver import without_unmeasured  # pylint: disable=import-outside-toplevel
  from meshrl.rl.algo.update import _update_metrics  # pylint: disable=import-outside-toplevel
  per = {"entropy": jnp.array([[2.0, 0.0], [4.0, 0.0]]), "ratio_mean": jnp.array([[1.0, 0.0], [1.1, 0.0]]),
         "logprob_diff_max": jnp.zeros((2, 2)), "clip_frac_low": jnp.zeros((2, 2)),
         "clip_frac_high": jnp.zeros((2, 2)), "skipped_minibatches": jnp.array([[0.0, 1.0], [0.0, 1.0]]),
         "nonfinite_minibatches": jnp.zeros((2, 2)), "applied": jnp.array([[1.0, 0.0], [1.0, 0.0]])}
  metrics = _update_metrics(dict(per))
  assert float(metrics["entropy"]) == 3.0 and float(metrics["updated_minibatches"]) == 0.5
  assert float(metrics["skipped_minibatches"]) == 0.5 and float(metrics["ratio_mean_first"]) == 1.0
  none = _update_metrics({**per, "applied": jnp.zeros((2, 2))})
  assert np.isnan(float(none["entropy"])) and float(none["updated_minibatches"]) == 0.0
  record = without_unmeasured({"reward_mean": 0.5, **{k: float(v) for k, v in none.items()}})
  assert "entropy" not in record and "ratio_mean_first" not in record
  assert record["reward_mean"] == 0.5 and record["skipped_minibatches"] == 0.5
