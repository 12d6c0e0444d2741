"""Advantage estimators: pure jnp functions of rewards (and values), jit-able with static shapes.

Axis legend: N samples (= P prompts x G samples per prompt), P prompts, G group size,
B sequences, T response tokens.

Samples of one prompt sit next to each other: the batch is laid out `[P * G]`, so a group is a
reshape to `[P, G]`. Every outcome estimator returns one scalar per sequence, `[N]`; the loop
broadcasts it over the response tokens.

Standard deviations are **unbiased** (ddof = 1), as `torch.std` in verl, Tunix (`ddof=1`), TRL and
OpenRLHF; EasyDeL and MaxText's legacy path use ddof = 0. With G = 2 rewards {0, 1} the unbiased
std is 0.707, so GRPO gives +-0.707 (not +-1).

`mask [N]` marks valid samples (a group thinned out by dynamic sampling keeps its static shape and
masks rows); statistics use valid samples only and invalid samples get advantage 0.

References: GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300); Dr. GRPO (Liu et al. 2025,
arXiv:2503.20783); RLOO (Ahmadian et al. 2024, arXiv:2402.14740); REINFORCE++ (Hu 2025,
arXiv:2501.03262); GAE (Schulman et al. 2015, arXiv:1506.02438).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


# --- helpers ---------------------------------------------------------------------------------


def _valid_mask(rewards: Array, mask: Array | None) -> Array:
  """Float mask `[N]` (all ones when `mask` is None)."""
  if mask is None:
    return jnp.ones(rewards.shape, jnp.float32)
  if mask.shape != rewards.shape:
    raise ValueError(f"mask.shape={mask.shape} must equal rewards.shape={rewards.shape}.")
  return mask.astype(jnp.float32)


def _grouped(values: Array, group_size: int, *, min_group: int = 2) -> Array:
  """`[N] -> [P, G]`, checking the layout."""
  if values.ndim != 1:
    raise ValueError(f"rewards must be 1-D [N], got shape {values.shape}.")
  if int(group_size) < min_group:
    raise ValueError(f"group_size={group_size} must be at least {min_group} for a group baseline.")
  if values.shape[0] % group_size:
    raise ValueError(
        f"len(rewards)={values.shape[0]} is not a multiple of group_size={group_size}; "
        "lay samples out contiguously as [num_prompts * group_size].")
  return values.reshape(-1, group_size)  # [P, G]


def _masked_mean_std(values: Array, weights: Array, axis) -> tuple[Array, Array]:
  """Mean and unbiased std of `values` over `axis`, counting only `weights == 1` entries."""
  count = jnp.sum(weights, axis=axis, keepdims=True)
  mean = jnp.sum(values * weights, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
  sq_dev = jnp.sum(weights * (values - mean) ** 2, axis=axis, keepdims=True)
  std = jnp.sqrt(sq_dev / jnp.maximum(count - 1.0, 1.0))
  return mean, std


def masked_whiten(values: Array, mask: Array, *, eps: float = 1e-8,
                  shift_mean: bool = True) -> Array:
  """(x - mean) / (std + eps) over the valid entries of any shape; invalid entries become 0."""
  weights = mask.astype(jnp.float32)
  mean, std = _masked_mean_std(values.reshape(-1), weights.reshape(-1), axis=0)
  centred = values - mean[0] if shift_mean else values
  return jnp.where(mask, centred / (std[0] + eps), 0.0)


# --- outcome estimators: rewards [N] -> advantages [N] ---------------------------------------


def grpo(rewards: Array, *, group_size: int, mask: Array | None = None, eps: float = 1e-6) -> Array:
  """GRPO: (r - group mean) / (group std + eps), std unbiased.

  Args:
    rewards: [N] scalar reward per sample, laid out [P * G].
    group_size: G, static, >= 2.
    mask: optional [N] valid samples.
    eps: added to the std (verl and Tunix use 1e-6).

  Returns:
    [N] float32 advantages.
  """
  weights = _grouped(_valid_mask(rewards, mask), group_size)
  grouped = _grouped(rewards.astype(jnp.float32), group_size)  # [P, G]
  mean, std = _masked_mean_std(grouped, weights, axis=1)  # [P, 1] each
  return ((grouped - mean) / (std + eps) * weights).reshape(-1)


def dr_grpo(rewards: Array, *, group_size: int, mask: Array | None = None) -> Array:
  """Dr. GRPO: r - group mean, no division by the std (removes the difficulty bias)."""
  weights = _grouped(_valid_mask(rewards, mask), group_size)
  grouped = _grouped(rewards.astype(jnp.float32), group_size)  # [P, G]
  mean, _ = _masked_mean_std(grouped, weights, axis=1)
  return ((grouped - mean) * weights).reshape(-1)


def rloo(rewards: Array, *, group_size: int, mask: Array | None = None) -> Array:
  """RLOO: r_i - mean of the other valid samples of the group (0 where a group has < 2 valid)."""
  weights = _grouped(_valid_mask(rewards, mask), group_size)
  grouped = _grouped(rewards.astype(jnp.float32), group_size)  # [P, G]
  count = jnp.sum(weights, axis=1, keepdims=True)
  total = jnp.sum(grouped * weights, axis=1, keepdims=True)
  others_mean = (total - grouped * weights) / jnp.maximum(count - 1.0, 1.0)
  return jnp.where((count >= 2) & (weights > 0), grouped - others_mean, 0.0).reshape(-1)


def reinforce_pp(rewards: Array, *, group_size: int, mask: Array | None = None, eps: float = 1e-6,
                 group_baseline: bool = False) -> Array:
  """REINFORCE++: rewards normalised over the whole batch, (r - batch mean) / batch std.

  This is the outcome-reward form (one scalar per sequence, KL not in the reward); with a
  per-token KL penalty in the reward use `reinforce_pp_tokens`. With `group_baseline=True` it is
  "REINFORCE++-baseline": subtract the group mean first, then divide by the batch std of the
  centred rewards (OpenRLHF's recommendation for verifiable rewards).

  Args:
    rewards: [N].
    group_size: G; only used (and checked) with `group_baseline=True`.
    mask: optional [N] valid samples.
    eps: added to the std.
    group_baseline: subtract the group mean before the batch normalisation.

  Returns:
    [N] advantages.
  """
  if rewards.ndim != 1:
    raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}.")
  weights = _valid_mask(rewards, mask)
  centred = rewards.astype(jnp.float32)
  if group_baseline:
    centred = dr_grpo(centred, group_size=group_size, mask=mask)
  mean, std = _masked_mean_std(centred, weights, axis=0)
  return (centred - mean) / (std + eps) * weights


def reinforce_pp_tokens(token_rewards: Array, mask: Array, *, gamma: float = 1.0,
                        eps: float = 1e-6) -> Array:
  """Token-level REINFORCE++: reward-to-go G_t = sum_{s>=t} gamma^(s-t) r_s, whitened over all
  valid tokens of the batch.

  Args:
    token_rewards: [B, T] per-token rewards (e.g. `outcome_token_rewards` plus a KL penalty).
    mask: [B, T] valid response tokens.
    gamma: discount (the paper uses 1).
    eps: added to the std.

  Returns:
    [B, T] advantages, 0 on masked tokens.
  """
  returns, _ = gae(token_rewards, jnp.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0)
  return masked_whiten(returns, mask, eps=eps)


def outcome_token_rewards(scores: Array, mask: Array) -> Array:
  """Puts each sequence's scalar score on its last valid token: `[B], [B, T] -> [B, T]`."""
  mask = mask.astype(bool)
  positions = jnp.arange(mask.shape[1])
  last = jnp.max(jnp.where(mask, positions, -1), axis=1)  # [B], -1 for an empty row
  at_last = (positions[None, :] == last[:, None]) & mask
  return jnp.where(at_last, scores.astype(jnp.float32)[:, None], 0.0)


# --- GAE over tokens, for a critic ------------------------------------------------------------


def gae(rewards: Array, values: Array, mask: Array, *, gamma: float, lam: float
        ) -> tuple[Array, Array]:
  """Generalised advantage estimation by a reverse `lax.scan` over tokens.

  delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, where t+1 is the next
  *valid* token (masked tokens are skipped, so padding or interleaved tool output does not break
  the recursion) and V = 0 after the last valid token.

  Args:
    rewards: [B, T] per-token rewards.
    values: [B, T] critic values.
    mask: [B, T] valid response tokens.
    gamma: discount.
    lam: GAE lambda.

  Returns:
    (advantages [B, T], returns [B, T] = advantages + values), both 0 on masked tokens.
  """
  if not rewards.shape == values.shape == mask.shape or rewards.ndim != 2:
    raise ValueError(f"rewards {rewards.shape}, values {values.shape} and mask {mask.shape} "
                     "must all be [B, T].")
  valid = mask.astype(bool)
  rewards = rewards.astype(jnp.float32)
  values = values.astype(jnp.float32)

  def step(carry, inputs):
    next_value, next_adv = carry  # [B] each
    reward_t, value_t, valid_t = inputs
    delta = reward_t + gamma * next_value - value_t
    adv = delta + gamma * lam * next_adv
    carry = (jnp.where(valid_t, value_t, next_value), jnp.where(valid_t, adv, next_adv))
    return carry, jnp.where(valid_t, adv, 0.0)

  init = (jnp.zeros(rewards.shape[0]), jnp.zeros(rewards.shape[0]))
  time_major = (rewards.T, values.T, valid.T)  # [T, B] each
  _, advantages = jax.lax.scan(step, init, time_major, reverse=True)
  advantages = advantages.T  # [B, T]
  returns = jnp.where(valid, advantages + values, 0.0)
  return advantages, returns


# --- registry: ESTIMATORS[cfg.rl.advantage], one protocol for all ------------------------------
#
# Every estimator is called the same way,
#   estimator(token_rewards [B, S], mask [B, S], sample_valid [B], values [B, S] or None,
#             *, group_size) -> (advantages [B, S], returns [B, S] or None),
# where token_rewards holds each sequence's outcome reward on its last loss token, minus the
# per-token KL penalty when the KL is in the reward. Outcome estimators see each sequence's summed
# token rewards (as verl does) and broadcast their one value per sequence over its tokens; token
# estimators (REINFORCE++, GAE) use the per-token rewards directly. So options compose: the KL in
# the reward reaches every estimator, none is swapped for another.


def _sequence_rewards(token_rewards: Array, mask: Array) -> Array:
  """[B, S] -> [B]: each sequence's summed token rewards."""
  return jnp.sum(jnp.where(mask, token_rewards.astype(jnp.float32), 0.0), axis=1)


def _broadcast(per_sequence: Array, mask: Array) -> Array:
  """[B] -> [B, S] over each sequence's loss tokens (0 elsewhere)."""
  return jnp.where(mask, per_sequence[:, None], 0.0)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """A group/batch estimator of one value per sequence, `fn(rewards [N], group_size, mask, **kw)`."""
  fn: Callable
  eps: float | None = None  # std epsilon, for estimators that normalise
  options: tuple[tuple[str, object], ...] = ()
  needs_critic = False
  needs_groups = True

  def __call__(self, token_rewards, mask, sample_valid, values=None, *, group_size):
    del values
    mask = mask.astype(bool)
    kwargs = dict(self.options)
    if self.eps is not None:
      kwargs["eps"] = self.eps
    per_sequence = self.fn(_sequence_rewards(token_rewards, mask), group_size=group_size,
                           mask=sample_valid, **kwargs)
    return _broadcast(per_sequence, mask), None


@dataclasses.dataclass(frozen=True)
class TokenReinforcePP:
  """REINFORCE++ (Hu 2025): per-token reward-to-go, whitened over the batch's valid tokens."""
  eps: float = 1e-6
  gamma: float = 1.0
  needs_critic = False
  needs_groups = False

  def __call__(self, token_rewards, mask, sample_valid, values=None, *, group_size):
    del values, group_size
    mask = mask.astype(bool) & sample_valid[:, None]
    return reinforce_pp_tokens(token_rewards, mask, gamma=self.gamma, eps=self.eps), None


@dataclasses.dataclass(frozen=True)
class GAE:
  """PPO with a critic: GAE over the token rewards and the critic's values.

  `whiten` normalises the advantages over the batch's valid tokens (Tunix, verl, purejaxrl).
  """
  gamma: float = 1.0
  lam: float = 1.0
  whiten: bool = True
  needs_critic = True
  needs_groups = False

  def __call__(self, token_rewards, mask, sample_valid, values=None, *, group_size):
    del group_size
    if values is None:
      raise ValueError("advantage='gae' needs the critic's values [B, S].")
    mask = mask.astype(bool) & sample_valid[:, None]
    advantages, returns = gae(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)
    if self.whiten:
      advantages = masked_whiten(advantages, mask)
    return advantages, returns


ESTIMATORS: dict[str, Callable] = {
    "grpo": Outcome(grpo, eps=1e-6),
    "dr_grpo": Outcome(dr_grpo),
    "rloo": Outcome(rloo),
    "reinforce_pp": TokenReinforcePP(),
    "reinforce_pp_baseline": Outcome(reinforce_pp, eps=1e-6, options=(("group_baseline", True),)),
    "gae": GAE(),
}


def make_estimator(name: str, *, eps: float = 1e-6, gamma: float = 1.0, lam: float = 1.0):
  """`ESTIMATORS[name]` with the config's numbers filled into the fields it has.

  Args:
    name: a key of ESTIMATORS (cfg.rl.advantage).
    eps: std epsilon (cfg.rl.adv_eps), for the normalising estimators.
    gamma: discount (cfg.rl.gamma), for REINFORCE++ and GAE.
    lam: GAE lambda (cfg.rl.gae_lambda).
  """
  if name not in ESTIMATORS:
    raise ValueError(f"rl.advantage={name!r} is unknown; choose one of {sorted(ESTIMATORS)}.")
  estimator = ESTIMATORS[name]
  fields = {f.name for f in dataclasses.fields(estimator)}
  given = {"gamma": gamma, "lam": lam}
  if "eps" in fields and getattr(estimator, "eps") is not None:
    given["eps"] = eps
  return dataclasses.replace(estimator, **{k: v for k, v in given.items() if k in fields})


def make_advantages(cfg, estimator=None):
  """The jitted advantage stage of the RL step, built from the config and `estimator` (the run
  spec's, rl/step/run_spec.RunSpec.estimator; default made from rl.advantage):

    advantages_fn(rewards [B], loss_mask [B, S], sample_valid [B], old_logprobs [B, S],
                  ref_logprobs [B, S] or None, values [B, S] or None)
      -> (advantages [B, S], returns [B, S] or None, metrics)

  The outcome reward goes on each sequence's last loss token; with rl.kl_in_reward the per-token
  penalty -kl_coef * KL(behaviour || reference) is added to the token rewards, and the configured
  estimator (whichever it is) sees the result. metrics: {"kl_reward": mean per-token penalty} when
  the KL is in the reward.
  """
  rl = cfg.rl
  if estimator is None:
    estimator = make_estimator(rl.advantage, eps=rl.adv_eps, gamma=rl.gamma, lam=rl.gae_lambda)
  group_size = int(rl.group_size)
  kl_in_reward, coef, kind = bool(rl.kl_in_reward), float(rl.kl_coef), rl.kl_estimator
  from meshrl.rl.algo.losses import kl_reward_penalty, masked_mean  # pylint: disable=import-outside-toplevel

  def advantages_fn(rewards, loss_mask, sample_valid, old_logprobs, ref_logprobs, values):
    mask = loss_mask.astype(bool) & sample_valid[:, None]
    token_rewards = outcome_token_rewards(rewards, mask)
    metrics = {}
    if kl_in_reward:
      if ref_logprobs is None:
        raise ValueError("rl.kl_in_reward=true needs reference log-probs.")
      penalty = kl_reward_penalty(old_logprobs, ref_logprobs, mask, coef=coef, kind=kind)
      token_rewards = token_rewards + penalty
      metrics["kl_reward"] = masked_mean(penalty, mask)
    advantages, returns = estimator(token_rewards, mask, sample_valid.astype(bool), values,
                                    group_size=group_size)
    return advantages, returns, metrics

  return jax.jit(advantages_fn)
