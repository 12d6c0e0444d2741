"""Losses against hand-computed numpy values on small arrays."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from meshrl.rl.algo import losses

RNG = np.random.default_rng(0)
B, T = 3, 4
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], bool)
OLD = RNG.normal(-1.0, 0.3, size=(B, T)).astype(np.float32)
LOGP = (OLD + RNG.normal(0.0, 0.3, size=(B, T))).astype(np.float32)
ADV = np.array([1.0, -0.5, 2.0], np.float32)


def _np_aggregate(per_token, mask, kind, max_len=None):
  if kind == "token_mean":
    return per_token[mask].sum() / mask.sum()
  sums = (per_token * mask).sum(1)
  if kind == "seq_mean_token_mean":
    return (sums / mask.sum(1)).mean()
  if kind == "seq_mean_token_sum":
    return sums.mean()
  return sums.sum() / (per_token.shape[0] * max_len)


def _np_ppo(logp, old, adv, clip_low, clip_high, dual_clip=0.0):
  ratio = np.exp(logp - old)
  a = np.broadcast_to(adv[:, None], logp.shape)
  loss = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_low, 1 + clip_high))
  if dual_clip:
    loss = np.where(a < 0, np.minimum(loss, -dual_clip * a), loss)
  return ratio, loss


@pytest.mark.parametrize("loss_agg", sorted(losses.AGGREGATIONS))
def test_policy_loss_each_aggregation(loss_agg):
  ratio, per_token = _np_ppo(LOGP, OLD, ADV, 0.2, 0.28)
  expected = _np_aggregate(per_token, MASK, loss_agg, max_len=T)
  loss, _ = losses.policy_loss(LOGP, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28,
                               loss_agg=loss_agg, max_len=T)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_policy_loss_metrics_and_token_advantages():
  ratio, per_token = _np_ppo(LOGP, OLD, ADV, 0.1, 0.1)
  token_adv = np.broadcast_to(ADV[:, None], (B, T))
  loss, metrics = losses.policy_loss(LOGP, OLD, token_adv, MASK, clip_low=0.1, clip_high=0.1)
  np.testing.assert_allclose(loss, per_token[MASK].mean(), rtol=1e-5)
  low = ((ratio < 0.9) & (token_adv < 0))[MASK].mean()
  high = ((ratio > 1.1) & (token_adv > 0))[MASK].mean()
  np.testing.assert_allclose(metrics["clip_frac_low"], low, rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac_high"], high, rtol=1e-6)
  np.testing.assert_allclose(metrics["ratio_mean"], ratio[MASK].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_max"], ratio[MASK].max(), rtol=1e-5)
  kl_old = (ratio - 1 - np.log(ratio))[MASK].mean()
  np.testing.assert_allclose(metrics["approx_kl_old"], kl_old, rtol=1e-4)
  assert 0 < low + high  # the fixture actually exercises clipping


def test_dual_clip_caps_negative_advantage_loss():
  logp = np.log(np.array([[5.0, 1.0, 0.5]], np.float32))
  old = np.zeros((1, 3), np.float32)
  adv = np.array([-1.0], np.float32)
  mask = np.ones((1, 3), bool)
  _, per_token = _np_ppo(logp, old, adv, 0.2, 0.2, dual_clip=3.0)
  np.testing.assert_allclose(per_token, [[3.0, 1.0, 0.8]], rtol=1e-6)  # 5 -> capped at 3
  loss, metrics = losses.policy_loss(logp, old, adv, mask, dual_clip=3.0)
  np.testing.assert_allclose(loss, per_token.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["dual_clip_frac"], 1 / 3, rtol=1e-6)
  with pytest.raises(ValueError, match="dual_clip=0.5"):
    losses.policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_clipped_tokens_get_no_gradient():
  old = np.zeros((1, 2), np.float32)
  logp = np.array([[0.5, 0.05]], np.float32)  # ratio 1.65 (clipped), 1.05 (inside)
  grad = jax.grad(lambda lp: losses.policy_loss(lp, old, jnp.array([1.0]), np.ones((1, 2), bool),
                                                clip_low=0.2, clip_high=0.2)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad, [[0.0, -np.exp(0.05) / 2]], rtol=1e-5)


def test_gspo_sequence_ratio_value_and_gradient():
  # Value: every token carries exp(mean over valid tokens of logp - old).
  ratios = losses.sequence_ratio(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(MASK))
  expected = np.exp(np.array([(LOGP - OLD)[b][MASK[b]].mean() for b in range(B)]))
  np.testing.assert_allclose(ratios, np.broadcast_to(expected[:, None], (B, T)), rtol=1e-5)

  # Gradient: token form + seq_mean_token_mean == the sequence-level GSPO objective.
  def sequence_objective(lp):
    seq = jnp.exp(jnp.sum(jnp.where(MASK, lp - OLD, 0.0), 1) / MASK.sum(1))
    clipped = jnp.clip(seq, 1 - 0.1, 1 + 0.1)
    return jnp.mean(jnp.maximum(-ADV * seq, -ADV * clipped))

  def token_form(lp):
    return losses.policy_loss(lp, OLD, ADV, MASK, clip_low=0.1, clip_high=0.1, ratio="sequence",
                              loss_agg="seq_mean_token_mean")[0]

  lp = jnp.asarray(LOGP)
  np.testing.assert_allclose(token_form(lp), sequence_objective(lp), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(token_form)(lp), jax.grad(sequence_objective)(lp),
                             rtol=1e-5, atol=1e-7)


def test_policy_loss_rejects_unknown_names():
  with pytest.raises(ValueError, match="ratio='seq'"):
    losses.policy_loss(LOGP, OLD, ADV, MASK, ratio="seq")
  with pytest.raises(ValueError, match="loss_agg='mean'"):
    losses.policy_loss(LOGP, OLD, ADV, MASK, loss_agg="mean")
  with pytest.raises(ValueError, match="max_len"):
    losses.policy_loss(LOGP, OLD, ADV, MASK, loss_agg="constant_norm")
  assert set(losses.POLICY_LOSS_RATIOS.values()) <= set(losses.RATIOS)


def test_policy_loss_jits():
  fn = jax.jit(lambda lp, old, a, m: losses.policy_loss(lp, old, a, m, clip_low=0.2, clip_high=0.28,
                                                        ratio="sequence", loss_agg="constant_norm",
                                                        max_len=T))
  loss, metrics = fn(LOGP, OLD, ADV, MASK)
  assert loss.shape == () and set(metrics) >= {"clip_frac_low", "clip_frac_high", "ratio_mean",
                                               "ratio_max"}


def test_kl_estimator_values():
  logp = np.array([-1.0, -2.0, -0.5], np.float32)
  ref = np.array([-1.5, -1.0, -0.5], np.float32)
  delta = logp - ref
  np.testing.assert_allclose(losses.kl(logp, ref, "k1"), delta, rtol=1e-6)
  np.testing.assert_allclose(losses.kl(logp, ref, "k2"), 0.5 * delta ** 2, rtol=1e-6)
  np.testing.assert_allclose(losses.kl(logp, ref, "k3"), np.exp(-delta) + delta - 1, rtol=1e-6)
  np.testing.assert_allclose(losses.kl(logp, ref, "k3+"), np.exp(-delta) + delta - 1, rtol=1e-6)
  with pytest.raises(ValueError, match="kl_estimator='k4'"):
    losses.kl(logp, ref, "k4")


def _expected_grad(kind, theta, ref_logp):
  """sum_x p(x) d/dtheta k(x) with p(x) held fixed: the expected gradient under samples from p."""
  def surrogate(th):
    logp = jax.nn.log_softmax(th)
    weights = jax.lax.stop_gradient(jnp.exp(logp))
    return jnp.sum(weights * losses.kl(logp, ref_logp, kind))
  return jax.grad(surrogate)(theta)


def test_kl_estimator_gradients_on_a_categorical():
  theta = jnp.array([0.3, -1.0, 0.8, 0.1, -0.4])
  ref_logp = jax.nn.log_softmax(jnp.array([0.0, 0.5, -0.3, 0.2, 0.9]))

  def reverse_kl(th):  # KL(p || q)
    logp = jax.nn.log_softmax(th)
    return jnp.sum(jnp.exp(logp) * (logp - ref_logp))

  def forward_kl(th):  # KL(q || p)
    return jnp.sum(jnp.exp(ref_logp) * (ref_logp - jax.nn.log_softmax(th)))

  true_reverse = jax.grad(reverse_kl)(theta)
  assert np.abs(true_reverse).max() > 1e-2
  np.testing.assert_allclose(_expected_grad("k2", theta, ref_logp), true_reverse, atol=1e-6)
  np.testing.assert_allclose(_expected_grad("k3+", theta, ref_logp), true_reverse, atol=1e-6)
  np.testing.assert_allclose(_expected_grad("k1", theta, ref_logp), np.zeros(5), atol=1e-6)
  np.testing.assert_allclose(_expected_grad("k3", theta, ref_logp), jax.grad(forward_kl)(theta),
                             atol=1e-6)


def test_kl_loss_and_reward_penalty():
  ref = OLD
  per_token = np.exp(ref - LOGP) - (ref - LOGP) - 1
  loss, metrics = losses.kl_loss(LOGP, ref, MASK, kind="k3", loss_agg="seq_mean_token_mean")
  np.testing.assert_allclose(loss, _np_aggregate(per_token, MASK, "seq_mean_token_mean"), rtol=1e-5)
  np.testing.assert_allclose(metrics["kl"], per_token[MASK].mean(), rtol=1e-5)
  penalty = losses.kl_reward_penalty(LOGP, ref, MASK, coef=0.1, kind="k1")
  np.testing.assert_allclose(penalty, np.where(MASK, -0.1 * (LOGP - ref), 0.0), rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(jax.grad(lambda lp: losses.kl_reward_penalty(
      lp, ref, MASK, coef=0.1).sum())(jnp.asarray(LOGP))) == 0)


def test_entropy_and_logprobs_from_logits():
  logits = RNG.normal(size=(2, 3, 5)).astype(np.float32)
  logits[0, 0, 1] = -np.inf  # a banned token must not give nan
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    expected = -np.nansum(np.where(probs > 0, probs * np.log(probs), 0.0), -1)
  np.testing.assert_allclose(losses.entropy_from_logits(logits), expected, rtol=1e-5)
  mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
  value, metrics = losses.entropy_loss(logits, mask)
  np.testing.assert_allclose(value, expected[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["entropy"], expected[mask].mean(), rtol=1e-5)
  tokens = np.array([[0, 2, 4], [1, 1, 3]])
  got = losses.logprobs_from_logits(logits, tokens)
  np.testing.assert_allclose(got, np.log(np.take_along_axis(probs, tokens[..., None], -1)[..., 0]),
                             rtol=1e-5)


def test_value_loss_clipped():
  values = np.array([[1.0, 0.9, 2.0]], np.float32)
  old = np.array([[0.5, 0.1, 2.1]], np.float32)
  returns = np.array([[0.0, 1.0, 2.0]], np.float32)
  mask = np.array([[1, 1, 0]], bool)
  clipped = old + np.clip(values - old, -0.2, 0.2)  # [0.7, 0.3, 2.0]
  per_token = 0.5 * np.maximum((values - returns) ** 2, (clipped - returns) ** 2)  # [0.5, 0.245, 0]
  loss, metrics = losses.value_loss(values, old, returns, mask, clip=0.2)
  np.testing.assert_allclose(loss, per_token[0, :2].mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["vf_clip_frac"], 0.5, rtol=1e-6)
  unclipped, _ = losses.value_loss(values, old, returns, mask, clip=0.0)
  np.testing.assert_allclose(unclipped, 0.5 * np.mean([1.0, 0.01]), rtol=1e-5)


@pytest.mark.parametrize("ratio", sorted(losses.RATIOS))
def test_padding_with_inf_logps_keeps_gradients_finite(ratio):
  logp = np.where(MASK, LOGP, -np.inf).astype(np.float32)
  old = np.where(MASK, OLD, np.nan).astype(np.float32)

  def total(lp):
    pg, _ = losses.policy_loss(lp, old, ADV, MASK, ratio=ratio)
    kl_value, _ = losses.kl_loss(lp, old, MASK, kind="k3")
    return pg + kl_value

  loss, grad = jax.value_and_grad(total)(jnp.asarray(logp))
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  assert np.all(np.asarray(grad)[~MASK] == 0)


# --- packed rows: per-sample reductions ----------------------------------------------------------


def _packed(x, fill=0.0):
  """The B=3 rows of MASK's real tokens packed into 2 rows of 6: row 0 = sample 0 (4) + sample 1
  (2), row 1 = sample 2 (3) + padding; returns (packed [2, 6], Sequences)."""
  ids = np.array([[0, 0, 0, 0, 1, 1], [2, 2, 2, -1, -1, -1]])
  cols = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
  out = np.where(ids >= 0, np.asarray(x)[np.maximum(ids, 0), cols], fill)
  return out, losses.Sequences(jnp.asarray(ids, jnp.int32), 3, 3)


@pytest.mark.parametrize("loss_agg", sorted(losses.AGGREGATIONS))
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_packed_rows_reduce_per_sample(loss_agg, ratio):
  """The policy loss and its gradient on packed rows equal those on one row per sample, for every
  aggregation and both ratios; reducing a packed row as one sequence would not."""
  packed_mask, seqs = _packed(MASK, False)
  adv_tokens = np.broadcast_to(ADV[:, None], (B, T))
  def padded_fn(lp):
    return losses.policy_loss(lp, OLD, adv_tokens, MASK, ratio=ratio, loss_agg=loss_agg, max_len=T)[0]
  def packed_fn(lp, sequences=seqs):
    return losses.policy_loss(lp, _packed(OLD)[0], _packed(adv_tokens)[0], packed_mask, ratio=ratio,
                              loss_agg=loss_agg, max_len=T, sequences=sequences)[0]
  lp = jnp.asarray(LOGP)
  want, want_grad = jax.value_and_grad(padded_fn)(lp)
  got, got_grad = jax.value_and_grad(packed_fn)(jnp.asarray(_packed(LOGP)[0]))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got_grad, _packed(want_grad)[0], rtol=1e-5, atol=1e-7)
  if loss_agg != "token_mean" or ratio == "sequence":
    rows_as_sequences = packed_fn(jnp.asarray(_packed(LOGP)[0]), None)
    assert abs(float(rows_as_sequences) - float(want)) > 1e-4


# --- truncated importance weights ----------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_are_one_unchanged_and_the_capped_ratio_otherwise(level):
  weights, metrics = losses.truncated_is_weights(OLD, OLD, MASK, level=level, cap=2.0)
  np.testing.assert_array_equal(np.asarray(weights)[MASK], 1.0)  # exactly, not approximately
  assert float(metrics["tis_weight_mean"]) == 1.0 and float(metrics["tis_truncated_frac"]) == 0.0
  behaviour = OLD - RNG.normal(0.0, 0.5, size=(B, T)).astype(np.float32)
  log_ratio = np.where(MASK, OLD - behaviour, 0.0)
  if level == "sequence":  # the product of the token ratios of each sequence
    log_ratio = np.broadcast_to(log_ratio.sum(1, keepdims=True), (B, T))
  want = np.minimum(np.exp(log_ratio), 1.5)
  weights, metrics = losses.truncated_is_weights(OLD, behaviour, MASK, level=level, cap=1.5)
  np.testing.assert_allclose(np.asarray(weights)[MASK], want[MASK], rtol=1e-5)
  assert 0.0 < float(metrics["tis_truncated_frac"]) < 1.0
  np.testing.assert_allclose(float(metrics["tis_truncated_frac"]), (np.exp(log_ratio) > 1.5)[MASK].mean())
  # Packed rows give each sample the same weights.
  packed, seqs = _packed(OLD)
  packed_w, _ = losses.truncated_is_weights(packed, _packed(behaviour)[0], _packed(MASK, False)[0],
                                            level=level, cap=1.5, sequences=seqs)
  np.testing.assert_allclose(np.asarray(packed_w), _packed(np.where(MASK, want, 0.0))[0], rtol=1e-5)
  # The weights multiply each token's surrogate loss and carry no gradient themselves.
  _, per_token = _np_ppo(LOGP, OLD, ADV, 0.2, 0.2)
  loss, _ = losses.policy_loss(LOGP, OLD, ADV, MASK, clip_low=0.2, clip_high=0.2, is_weights=weights)
  np.testing.assert_allclose(float(loss), (per_token * want)[MASK].mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="rl.tis_cap=0.9 must be >= 1"):
    losses.truncated_is_weights(OLD, OLD, MASK, level=level, cap=0.9)
  with pytest.raises(ValueError, match="rl.tis_level='seq'"):
    losses.truncated_is_weights(OLD, OLD, MASK, level="seq", cap=2.0)
