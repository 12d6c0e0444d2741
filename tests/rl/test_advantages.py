"""Advantage estimators against independent numpy computations."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from meshrl.rl.algo import advantages as adv

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 2.0], np.float32)  # P = 2, G = 4
G = 4


def test_grpo_matches_numpy_unbiased_std():
  expected = []
  for group in REWARDS.reshape(-1, G):
    expected.append((group - group.mean()) / (group.std(ddof=1) + 1e-6))
  got = adv.grpo(jnp.asarray(REWARDS), group_size=G)
  np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-5, atol=1e-6)


def test_grpo_two_samples_gives_0707():
  got = adv.grpo(jnp.array([1.0, 0.0]), group_size=2)
  np.testing.assert_allclose(got, [0.70710678, -0.70710678], rtol=1e-5)


def test_grpo_equal_rewards_give_zero():
  got = adv.grpo(jnp.ones(6), group_size=3)
  np.testing.assert_array_equal(got, np.zeros(6))


def test_dr_grpo_is_group_centred():
  expected = (REWARDS.reshape(-1, G) - REWARDS.reshape(-1, G).mean(1, keepdims=True)).reshape(-1)
  np.testing.assert_allclose(adv.dr_grpo(jnp.asarray(REWARDS), group_size=G), expected, atol=1e-6)


def test_rloo_leave_one_out():
  expected = []
  for group in REWARDS.reshape(-1, G):
    expected += [group[i] - np.delete(group, i).mean() for i in range(G)]
  np.testing.assert_allclose(adv.rloo(jnp.asarray(REWARDS), group_size=G), expected, atol=1e-6)


def test_reinforce_pp_batch_normalised():
  expected = (REWARDS - REWARDS.mean()) / (REWARDS.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(adv.reinforce_pp(jnp.asarray(REWARDS), group_size=G), expected,
                             rtol=1e-5, atol=1e-6)


def test_reinforce_pp_group_baseline():
  centred = (REWARDS.reshape(-1, G) - REWARDS.reshape(-1, G).mean(1, keepdims=True)).reshape(-1)
  expected = (centred - centred.mean()) / (centred.std(ddof=1) + 1e-6)
  got = adv.reinforce_pp(jnp.asarray(REWARDS), group_size=G, group_baseline=True)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_mask_excludes_samples_from_group_statistics():
  mask = np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)
  got = np.asarray(adv.grpo(jnp.asarray(REWARDS), group_size=G, mask=jnp.asarray(mask)))
  first = REWARDS[:3]
  np.testing.assert_allclose(got[:3], (first - first.mean()) / (first.std(ddof=1) + 1e-6), rtol=1e-5)
  assert got[3] == 0.0
  loo = np.asarray(adv.rloo(jnp.asarray(REWARDS), group_size=G, mask=jnp.asarray(mask)))
  np.testing.assert_allclose(loo[:3], [1.0, -0.5, -0.5], atol=1e-6)
  assert loo[3] == 0.0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_estimators_reject_bad_group_size(name):
  fn = getattr(adv, name)
  with pytest.raises(ValueError, match="group_size=1"):
    fn(jnp.ones(4), group_size=1, **({"group_baseline": True} if name == "reinforce_pp" else {}))
  if name != "reinforce_pp":
    with pytest.raises(ValueError, match="multiple of group_size=3"):
      fn(jnp.ones(4), group_size=3)


def _token_inputs():
  """8 sequences x 5 tokens: outcome rewards on each row's last loss token, ragged masks."""
  lengths = np.array([5, 3, 1, 4, 2, 5, 3, 4])
  mask = np.arange(5)[None, :] < lengths[:, None]
  token_rewards = np.zeros((8, 5), np.float32)
  token_rewards[np.arange(8), lengths - 1] = REWARDS
  return jnp.asarray(token_rewards), jnp.asarray(mask)


def test_registry_one_protocol_and_jit():
  """Every estimator: (token_rewards, mask, valid, values, group_size) -> [B, S] advantages, 0 off
  the mask; outcome estimators put their per-sequence value (from the summed token rewards) on
  every loss token."""
  token_rewards, mask = _token_inputs()
  valid = jnp.ones(8, bool)
  values = jnp.zeros((8, 5))
  for name, estimator in adv.ESTIMATORS.items():
    direct, returns = estimator(token_rewards, mask, valid, values, group_size=G)
    jitted, _ = jax.jit(lambda r, m, v, x, e=estimator: e(r, m, v, x, group_size=G))(
        token_rewards, mask, valid, values)
    assert direct.shape == (8, 5), name
    np.testing.assert_allclose(direct, jitted, atol=1e-6, err_msg=name)
    assert np.all(np.asarray(direct)[~np.asarray(mask)] == 0), name
    assert (returns is not None) == estimator.needs_critic, name
  expected = {"grpo": adv.grpo(jnp.asarray(REWARDS), group_size=G),
              "rloo": adv.rloo(jnp.asarray(REWARDS), group_size=G)}
  for name, per_sequence in expected.items():
    got, _ = adv.ESTIMATORS[name](token_rewards, mask, valid, None, group_size=G)
    np.testing.assert_allclose(got, np.where(mask, np.asarray(per_sequence)[:, None], 0), atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_kl_in_reward_reaches_the_configured_estimator(name):
  """With rl.kl_in_reward the estimator stays the configured one and sees reward - coef * sum KL."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [f"rl.advantage={name}", "rl.kl_coef=0.5", "rl.kl_in_reward=true",
                                         "rl.kl_estimator=k1", f"rl.group_size={G}"])
  token_rewards, mask = _token_inputs()
  rng = np.random.default_rng(1)
  old = jnp.asarray(rng.normal(size=(8, 5)).astype(np.float32))
  ref = jnp.asarray(rng.normal(size=(8, 5)).astype(np.float32))
  valid = jnp.ones(8, bool)
  got, _, metrics = adv.make_advantages(cfg)(jnp.asarray(REWARDS), mask, valid, old, ref, None)
  penalty = np.where(mask, -0.5 * (np.asarray(old) - np.asarray(ref)), 0.0)  # k1
  shaped = np.asarray(token_rewards) + penalty
  want, _ = adv.ESTIMATORS[name](jnp.asarray(shaped), mask, valid, None, group_size=G)
  np.testing.assert_allclose(got, want, atol=1e-5)
  without, _ = adv.ESTIMATORS[name](token_rewards, mask, valid, None, group_size=G)
  assert np.abs(np.asarray(got) - np.asarray(without)).max() > 1e-3  # the KL really reached it
  np.testing.assert_allclose(metrics["kl_reward"], penalty[np.asarray(mask)].mean(), rtol=1e-5)
  if name == "grpo":  # and it is GRPO of the summed rewards, not another estimator
    per_sequence = adv.grpo(jnp.asarray(shaped.sum(axis=1)), group_size=G)
    np.testing.assert_allclose(got, np.where(mask, np.asarray(per_sequence)[:, None], 0), atol=1e-5)


def test_make_estimator_fills_fields_and_rejects_unknown():
  assert adv.make_estimator("grpo", eps=1e-3).eps == 1e-3
  gae = adv.make_estimator("gae", gamma=0.9, lam=0.8, eps=1.0)
  assert (gae.gamma, gae.lam) == (0.9, 0.8)
  with pytest.raises(ValueError, match="advantage='ppo2'"):
    adv.make_estimator("ppo2")


def _gae_numpy(rewards, values, mask, gamma, lam):
  """Plain loop over each row's valid tokens."""
  advantages = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    valid = np.nonzero(mask[b])[0]
    next_value, next_adv = 0.0, 0.0
    for t in valid[::-1]:
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      next_adv = delta + gamma * lam * next_adv
      next_value = values[b, t]
      advantages[b, t] = next_adv
  return advantages, np.where(mask, advantages + values, 0.0)


def test_gae_matches_numpy_loop():
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=(3, 6)).astype(np.float32)
  values = rng.normal(size=(3, 6)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0]], bool)  # gap in row 2
  expected_adv, expected_ret = _gae_numpy(rewards, values, mask, 0.9, 0.8)
  got_adv, got_ret = jax.jit(lambda r, v, m: adv.gae(r, v, m, gamma=0.9, lam=0.8))(rewards, values, mask)
  np.testing.assert_allclose(got_adv, expected_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_ret, expected_ret, rtol=1e-5, atol=1e-5)


def test_outcome_token_rewards_and_reinforce_pp_tokens():
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
  placed = adv.outcome_token_rewards(jnp.array([2.0, -1.0, 5.0]), jnp.asarray(mask))
  np.testing.assert_array_equal(placed, [[0, 0, 2, 0], [0, -1, 0, 0], [0, 0, 0, 0]])
  returns = np.array([[2, 2, 2, 0], [-1, -1, 0, 0], [0, 0, 0, 0]], np.float32)  # gamma = 1
  valid = returns[mask]
  expected = np.where(mask, (returns - valid.mean()) / (valid.std(ddof=1) + 1e-6), 0.0)
  got = adv.reinforce_pp_tokens(placed, jnp.asarray(mask))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gae_estimator_whitens_over_valid_tokens():
  rewards = np.array([[0.0, 1.0], [0.0, 0.0]], np.float32)
  values = np.array([[0.5, 0.2], [0.1, 0.3]], np.float32)
  mask = np.array([[1, 1], [1, 0]], bool)
  raw, returns = _gae_numpy(rewards, values, mask, 1.0, 1.0)
  valid = raw[mask]
  expected = np.where(mask, (raw - valid.mean()) / (valid.std(ddof=1) + 1e-8), 0.0)
  got_adv, got_ret = adv.ESTIMATORS["gae"](rewards, mask, jnp.ones(2, bool), values, group_size=1)
  np.testing.assert_allclose(got_adv, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_ret, returns, rtol=1e-6)
