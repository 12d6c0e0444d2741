"""Policy, KL, entropy and value losses: pure functions of arrays, each variant named by a string.

Axis legend: B sequences, T response tokens, V vocabulary.

Every per-token quantity is reduced by one of `AGGREGATIONS` (cfg.rl.loss_agg); the policy ratio is
one of `RATIOS` (token-level PPO or sequence-level GSPO, cfg.rl.policy_loss via
`POLICY_LOSS_RATIOS`); the KL estimator is one of `KL_ESTIMATORS` (cfg.rl.kl_estimator). Numeric
options (clip ranges, names) are static Python values, not traced arrays.

Sequences: a row of a padded batch is one sequence; a row of a packed batch (rl/batches/packing.py) holds
several, told apart by `Sequences.ids` [B, T] (the sample of each token). Every per-sequence
reduction (sequence aggregations, the GSPO ratio, sequence-level importance weights) takes an
optional `sequences` and reduces per sample, so the packed and the padded layout give the same loss.

Truncated importance sampling (TIS) corrects for a behaviour policy (the rollout: an older policy
version in asynchronous RL, or generation numerics that differ from training) that is not the
proximal policy `old_logp` of the clipped ratio: the policy loss is weighted by
min(pi_old / pi_behaviour, cap), per token or per sequence (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's rollout correction, where the
sequence level is the product of the token ratios).

References: PPO (Schulman et al. 2017, arXiv:1707.06347); dual-clip PPO (Ye et al. 2019,
arXiv:1912.09729); DAPO clip-higher and token-level loss (Yu et al. 2025, arXiv:2503.14476);
Dr. GRPO constant normaliser (Liu et al. 2025, arXiv:2503.20783); GSPO (Zheng et al. 2025,
arXiv:2507.18071); KL estimators k1/k2/k3 (Schulman, "Approximating KL divergence", 2020).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp, so one wild token cannot overflow.
LOG_RATIO_CLAMP = 20.0


# --- masked reductions and loss aggregation ---------------------------------------------------


def masked_sum(values: Array, mask: Array, axis=None) -> Array:
  """Sum of `values` where `mask`, over `axis` (all axes when None)."""
  return jnp.sum(jnp.where(mask, values, 0.0), axis=axis)


def masked_mean(values: Array, mask: Array, axis=None) -> Array:
  """Mean of `values` where `mask` (0 where nothing is valid)."""
  count = jnp.sum(mask.astype(jnp.float32), axis=axis)
  return masked_sum(values, mask, axis) / jnp.maximum(count, 1.0)


def _zero_masked(mask: Array, *arrays: Array) -> tuple[Array, ...]:
  """Replaces masked entries by 0 so padding (even -inf or nan there) cannot poison gradients."""
  return tuple(jnp.where(mask, array, 0.0) for array in arrays)


class Sequences(NamedTuple):
  """Which sequence each token of a packed batch belongs to (rl/batches/packing.py)."""
  ids: Array  # [B, T] int32: the sample of each token, -1 on padding
  count: int  # static: number of samples the ids range over
  norm_count: int  # static: sequences per minibatch of the padded layout (constant_norm's B)


def sequence_sums(values: Array, mask: Array, sequences: Sequences | None = None) -> Array:
  """Masked sum per sequence: `[B, T] -> [B]` per row, or `-> [count]` per sample when packed."""
  if sequences is None:
    return masked_sum(values, mask, axis=1)
  ids = jnp.where(mask & (sequences.ids >= 0), sequences.ids, sequences.count)  # count = discard
  sums = jax.ops.segment_sum(jnp.where(mask, values, 0.0).reshape(-1).astype(jnp.float32),
                             ids.reshape(-1), num_segments=sequences.count + 1)
  return sums[:-1]


def to_tokens(per_sequence: Array, shape, sequences: Sequences | None = None) -> Array:
  """Each token gets its sequence's value: `[B] or [count] -> [B, T]` (0 on packed padding)."""
  if sequences is None:
    return jnp.broadcast_to(per_sequence[:, None], shape)
  return jnp.where(sequences.ids >= 0, per_sequence[jnp.maximum(sequences.ids, 0)], 0.0)


def token_mean(per_token: Array, mask: Array, *, max_len: int | None = None,
               sequences: Sequences | None = None) -> Array:
  """Sum over every valid token of the batch / number of valid tokens (DAPO, verl default).

  Global over this batch only: split into micro-batches, the mean is per micro-batch.
  """
  del max_len, sequences
  return masked_mean(per_token, mask)


def _sequence_mean(per_token: Array, mask: Array, sequences: Sequences | None, *, token_mean_first: bool
                   ) -> Array:
  """Mean over the sequences with at least one valid token of their token sums (or token means)."""
  sums = sequence_sums(per_token, mask, sequences)
  counts = sequence_sums(jnp.ones(per_token.shape, jnp.float32), mask, sequences)
  per_sequence = sums / jnp.maximum(counts, 1.0) if token_mean_first else sums
  return masked_mean(per_sequence, counts > 0)


def seq_mean_token_mean(per_token: Array, mask: Array, *, max_len: int | None = None,
                        sequences: Sequences | None = None) -> Array:
  """Token-mean within each sequence, then mean over sequences (GRPO paper, Tunix default)."""
  del max_len
  return _sequence_mean(per_token, mask, sequences, token_mean_first=True)


def seq_mean_token_sum(per_token: Array, mask: Array, *, max_len: int | None = None,
                       sequences: Sequences | None = None) -> Array:
  """Token-sum within each sequence, then mean over sequences."""
  del max_len
  return _sequence_mean(per_token, mask, sequences, token_mean_first=False)


def constant_norm(per_token: Array, mask: Array, *, max_len: int | None = None,
                  sequences: Sequences | None = None) -> Array:
  """Dr. GRPO: sum over valid tokens / (B * max_len), a constant that does not depend on lengths.

  B is the number of sequences of a minibatch of the padded layout (its rows; `norm_count` packed).
  """
  if max_len is None or max_len <= 0:
    raise ValueError(
        f"loss_agg='constant_norm' needs max_len > 0 (the response budget), got {max_len=}.")
  count = per_token.shape[0] if sequences is None else sequences.norm_count
  return masked_sum(per_token, mask) / (count * max_len)


AGGREGATIONS: dict[str, Callable] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "constant_norm": constant_norm,
}


def aggregate(per_token: Array, mask: Array, *, loss_agg: str = "token_mean",
              max_len: int | None = None, sequences: Sequences | None = None) -> Array:
  """Reduces `[B, T]` per-token values to a scalar with `AGGREGATIONS[loss_agg]`."""
  if loss_agg not in AGGREGATIONS:
    raise ValueError(f"loss_agg={loss_agg!r} is unknown; choose one of {sorted(AGGREGATIONS)}.")
  return AGGREGATIONS[loss_agg](per_token, mask.astype(bool), max_len=max_len, sequences=sequences)


# --- importance ratios ------------------------------------------------------------------------


def token_ratio(logp: Array, old_logp: Array, mask: Array, sequences: Sequences | None = None) -> Array:
  """PPO: r_t = exp(logp_t - old_logp_t), `[B, T]`."""
  del mask, sequences
  return jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def sequence_ratio(logp: Array, old_logp: Array, mask: Array, sequences: Sequences | None = None
                   ) -> Array:
  """GSPO-token: s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]), `[B, T]`.

  s_i = exp(mean over valid tokens of (logp - old_logp)) is the length-normalised sequence ratio.
  Every token carries the value s_i; the gradient reaching token t is s_i * grad logp_t, so with
  one advantage per sequence and `seq_mean_token_mean` the gradient equals sequence-level GSPO's.
  """
  counts = sequence_sums(jnp.ones(logp.shape, jnp.float32), mask, sequences)
  seq_log_ratio = sequence_sums(logp - old_logp, mask, sequences) / jnp.maximum(counts, 1.0)  # [B]
  seq_ratio = jnp.exp(jnp.clip(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  token_grad = jnp.exp(logp - jax.lax.stop_gradient(logp))  # value 1, gradient grad logp
  return to_tokens(jax.lax.stop_gradient(seq_ratio), logp.shape, sequences) * token_grad


RATIOS: dict[str, Callable] = {"token": token_ratio, "sequence": sequence_ratio}
# cfg.rl.policy_loss -> ratio kind.
POLICY_LOSS_RATIOS: dict[str, str] = {"ppo": "token", "gspo": "sequence"}


# --- clipped policy loss ----------------------------------------------------------------------


def policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float = 0.0,
                loss_agg: str = "token_mean", ratio: str = "token",
                max_len: int | None = None, sequences: Sequences | None = None,
                is_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Clipped surrogate loss (to minimise): max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

  Args:
    logp: [B, T] log-probs of the sampled tokens under the current policy.
    old_logp: [B, T] log-probs under the behaviour policy (the rollout).
    advantages: [B, T], or [B] (one per sequence, broadcast over tokens).
    mask: [B, T] valid response tokens.
    clip_low: ratio lower bound is 1 - clip_low.
    clip_high: ratio upper bound is 1 + clip_high (DAPO clip-higher: 0.28 with clip_low 0.2).
    dual_clip: c > 1 caps the loss of negative-advantage tokens at -c A; 0 turns it off.
    loss_agg: a key of AGGREGATIONS.
    ratio: a key of RATIOS, "token" (PPO) or "sequence" (GSPO).
    max_len: response budget, needed by loss_agg="constant_norm".
    sequences: the sequence of each token of a packed batch (None: each row is one sequence).
    is_weights: [B, T] importance weights (constants, e.g. `truncated_is_weights`) multiplying
      each token's surrogate loss before aggregation; None = 1.

  Returns:
    (loss scalar, metrics): pg_loss, clip_frac_low (ratio below 1 - clip_low with A < 0),
    clip_frac_high (ratio above 1 + clip_high with A > 0), dual_clip_frac, ratio_mean, ratio_max,
    approx_kl_old (k3 estimate of KL(old || current)); fractions and means over valid tokens.
  """
  if ratio not in RATIOS:
    raise ValueError(f"ratio={ratio!r} is unknown; choose one of {sorted(RATIOS)}.")
  if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
    raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low=}, {clip_high=}.")
  if dual_clip != 0.0 and dual_clip <= 1.0:
    raise ValueError(f"dual_clip={dual_clip} must be 0 (off) or greater than 1.")
  if advantages.ndim == 1:
    advantages = advantages[:, None]  # [B, 1]
  mask = mask.astype(bool)
  logp, old_logp = _zero_masked(mask, logp, old_logp)
  advantages = jnp.broadcast_to(advantages, logp.shape).astype(jnp.float32)
  advantages = jax.lax.stop_gradient(advantages)

  # Surrogate: the pessimistic (larger) of the unclipped and clipped losses.
  ratios = RATIOS[ratio](logp, old_logp, mask, sequences)
  loss_unclipped = -advantages * ratios
  loss_clipped = -advantages * jnp.clip(ratios, 1.0 - clip_low, 1.0 + clip_high)
  per_token = jnp.maximum(loss_unclipped, loss_clipped)
  # Dual clip: for A < 0 the loss never exceeds -c A, however large the ratio.
  dual_active = jnp.zeros_like(mask)
  if dual_clip:
    dual_active = (advantages < 0) & (per_token > -dual_clip * advantages)
    per_token = jnp.where(dual_active, -dual_clip * advantages, per_token)
  if is_weights is not None:
    per_token = per_token * jax.lax.stop_gradient(is_weights)
  loss = aggregate(per_token, mask, loss_agg=loss_agg, max_len=max_len, sequences=sequences)

  # Metrics, outside the gradient.
  ratios = jax.lax.stop_gradient(ratios)
  log_ratio = jnp.clip(jax.lax.stop_gradient(logp - old_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  metrics = {
      "pg_loss": jax.lax.stop_gradient(loss),
      "clip_frac_low": masked_mean((ratios < 1.0 - clip_low) & (advantages < 0), mask),
      "clip_frac_high": masked_mean((ratios > 1.0 + clip_high) & (advantages > 0), mask),
      "dual_clip_frac": masked_mean(dual_active, mask),
      "ratio_mean": masked_mean(ratios, mask),
      "ratio_max": jnp.max(jnp.where(mask, ratios, 0.0)),
      "approx_kl_old": masked_mean(jnp.exp(log_ratio) - 1.0 - log_ratio, mask),
  }
  return loss, metrics


# --- truncated importance weights (behaviour policy != proximal policy) -----------------------

TIS_LEVELS = ("none", "token", "sequence")


def truncated_is_weights(old_logp: Array, behaviour_logp: Array, mask: Array, *, level: str,
                         cap: float, sequences: Sequences | None = None
                         ) -> tuple[Array, dict[str, Array]]:
  """TIS weights min(pi_old / pi_behaviour, cap), constants of the update: `[B, T]`.

  Args:
    old_logp: [B, T] log-probs under the proximal policy (recomputed with the update's params).
    behaviour_logp: [B, T] log-probs under the policy that generated the tokens (the rollout).
    mask: [B, T] valid tokens.
    level: "token" (each token's ratio) or "sequence" (the product of a sequence's token ratios,
      exp of the summed log-ratio, on every token of it).
    cap: truncation, >= 1 so that an unchanged policy gets weight exactly 1.
    sequences: the sequence of each token of a packed batch (None: rows are sequences).

  Returns:
    (weights [B, T], 0 on masked tokens; metrics tis_weight_mean and tis_truncated_frac, the
    share of valid tokens whose ratio exceeded the cap).
  """
  if level not in ("token", "sequence"):
    raise ValueError(f"rl.tis_level={level!r}; choose one of {TIS_LEVELS}.")
  if not cap >= 1.0:
    raise ValueError(f"rl.tis_cap={cap} must be >= 1 (an unchanged policy has ratio 1).")
  mask = mask.astype(bool)
  log_ratio = jnp.where(mask, old_logp - behaviour_logp, 0.0)
  if level == "sequence":
    log_ratio = to_tokens(sequence_sums(log_ratio, mask, sequences), log_ratio.shape, sequences)
  ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  weights = jax.lax.stop_gradient(jnp.where(mask, jnp.minimum(ratio, cap), 0.0))
  return weights, {"tis_weight_mean": masked_mean(weights, mask),
                   "tis_truncated_frac": masked_mean(jax.lax.stop_gradient(ratio) > cap, mask)}


# --- KL to the reference policy ---------------------------------------------------------------


def kl_k1(logp: Array, ref_logp: Array) -> Array:
  """k1 = logp - ref_logp: unbiased for KL(pi || ref), can be negative; zero expected gradient."""
  return logp - ref_logp


def kl_k2(logp: Array, ref_logp: Array) -> Array:
  """k2 = (logp - ref_logp)^2 / 2: biased but its expected gradient is grad KL(pi || ref)."""
  return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Array, ref_logp: Array) -> Array:
  """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, >= 0; its expected gradient is that of
  the forward KL(ref || pi)."""
  log_ratio = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return jnp.exp(log_ratio) - log_ratio - 1.0


def _straight_through(value_fn: Callable) -> Callable:
  """Forward value of `value_fn`, gradient of k2 (verl's "k1+" / "k3+")."""
  def estimator(logp, ref_logp):
    grad_part = kl_k2(logp, ref_logp)
    return grad_part + jax.lax.stop_gradient(value_fn(logp, ref_logp) - grad_part)
  return estimator


KL_ESTIMATORS: dict[str, Callable] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k1+": _straight_through(kl_k1),
    "k3+": _straight_through(kl_k3),
}


def kl(logp: Array, ref_logp: Array, kind: str = "k3") -> Array:
  """Per-token KL estimate `[B, T]` from sampled-token log-probs, `KL_ESTIMATORS[kind]`."""
  if kind not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator={kind!r} is unknown; choose one of {sorted(KL_ESTIMATORS)}.")
  return KL_ESTIMATORS[kind](logp, ref_logp)


def kl_loss(logp: Array, ref_logp: Array, mask: Array, *, kind: str = "k3",
            loss_agg: str = "token_mean", max_len: int | None = None,
            sequences: Sequences | None = None) -> tuple[Array, dict[str, Array]]:
  """KL in the loss (GRPO style): aggregated estimate and metric {"kl": token mean}."""
  mask = mask.astype(bool)
  per_token = kl(*_zero_masked(mask, logp, ref_logp), kind)
  loss = aggregate(per_token, mask, loss_agg=loss_agg, max_len=max_len, sequences=sequences)
  return loss, {"kl": masked_mean(jax.lax.stop_gradient(per_token), mask.astype(bool))}


def kl_reward_penalty(logp: Array, ref_logp: Array, mask: Array, *, coef: float,
                      kind: str = "k1") -> Array:
  """KL in the reward (PPO style): per-token reward -coef * KL_t, `[B, T]`, no gradient.

  Add it to `advantages.outcome_token_rewards(scores, mask)` before GAE or REINFORCE++.
  """
  mask = mask.astype(bool)
  per_token = jax.lax.stop_gradient(kl(*_zero_masked(mask, logp, ref_logp), kind))
  return jnp.where(mask, -coef * per_token, 0.0)


# --- entropy, log-probs, value loss -----------------------------------------------------------


def logprobs_from_logits(logits: Array, tokens: Array) -> Array:
  """Log-prob of each token: `logits [B, T, V], tokens [B, T] int -> [B, T]` (float32)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


def entropy_from_logits(logits: Array) -> Array:
  """Entropy of each next-token distribution: `logits [B, T, V] -> [B, T]` (float32)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  probs = jnp.exp(log_probs)
  return -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)


def entropy_term(per_token: Array, mask: Array, *, loss_agg: str = "token_mean",
                 max_len: int | None = None, sequences: Sequences | None = None
                 ) -> tuple[Array, dict[str, Array]]:
  """Aggregated per-token entropies `[B, T]` (add `-entropy_coef * value` to the loss) and the
  metric {"entropy"}; the entropies come from dense logits or chunk by chunk."""
  value = aggregate(per_token, mask, loss_agg=loss_agg, max_len=max_len, sequences=sequences)
  return value, {"entropy": masked_mean(jax.lax.stop_gradient(per_token), mask.astype(bool))}


def entropy_loss(logits: Array, mask: Array, *, loss_agg: str = "token_mean",
                 max_len: int | None = None) -> tuple[Array, dict[str, Array]]:
  """`entropy_term` of the entropies of `logits [B, T, V]`."""
  return entropy_term(entropy_from_logits(logits), mask, loss_agg=loss_agg, max_len=max_len)


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               clip: float = 0.2, loss_agg: str = "token_mean", max_len: int | None = None,
               sequences: Sequences | None = None) -> tuple[Array, dict[str, Array]]:
  """Clipped critic loss: 1/2 max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2).

  Args:
    values: [B, T] current critic values.
    old_values: [B, T] values at rollout time.
    returns: [B, T] targets (GAE returns).
    mask: [B, T] valid tokens.
    clip: value clip range; 0 turns clipping off.
    loss_agg: a key of AGGREGATIONS.
    max_len: for loss_agg="constant_norm".
    sequences: the sequence of each token of a packed batch (None: rows are sequences).

  Returns:
    (loss, metrics): vf_loss, vf_clip_frac (tokens where the clipped term is larger), value_mean.
  """
  if clip < 0:
    raise ValueError(f"value clip={clip} must be >= 0 (0 = no clipping).")
  mask = mask.astype(bool)
  values, old_values, returns = _zero_masked(mask, values, old_values, returns)
  returns = jax.lax.stop_gradient(returns)
  loss_unclipped = (values - returns) ** 2
  if clip:
    clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
    loss_clipped = (clipped_values - returns) ** 2
  else:
    loss_clipped = loss_unclipped
  per_token = 0.5 * jnp.maximum(loss_unclipped, loss_clipped)
  loss = aggregate(per_token, mask, loss_agg=loss_agg, max_len=max_len, sequences=sequences)
  metrics = {
      "vf_loss": jax.lax.stop_gradient(loss),
      "vf_clip_frac": masked_mean(loss_clipped > loss_unclipped, mask),
      "value_mean": masked_mean(jax.lax.stop_gradient(values), mask),
  }
  return loss, metrics


# --- the frozen spec of numbers the jitted RL loss receives -----------------------------------


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """Every number and switch of the RL objective, resolved once from the config.

  The jitted loss (rl/algo/update.py) receives this, never config sections, so which terms are on is
  decided here and `UpdateBatch.check(spec)` refuses a batch that lacks what a term needs.
  """
  temperature: float  # log-probs are recomputed at the sampling temperature
  ratio: str  # a key of RATIOS
  clip_low: float
  clip_high: float
  dual_clip: float
  loss_agg: str  # a key of AGGREGATIONS
  max_len: int  # response budget, for constant_norm
  entropy_coef: float
  kl_coef: float  # weight of the KL term in the loss (0 when off or when the KL is in the reward)
  kl_metric: bool  # reference log-probs are present (KL in the loss or in the reward): report KL
  kl_estimator: str
  value_coef: float  # critic loss weight (0 without a critic)
  value_clip: float
  replay_routing: bool  # MoE: the update replays the rollout's expert choices
  moe: bool  # the model has MoE layers (routing exists)
  aux_loss_coef: float
  z_loss_coef: float
  tis_level: str = "none"  # truncated importance weights vs the behaviour policy: one of TIS_LEVELS
  tis_cap: float = 2.0  # their truncation
  packed: bool = False  # update batches are packed rows (rl/batches/packing.py) carrying sequence_ids
  num_sequences: int = 0  # samples per update batch (the range of sequence_ids)
  minibatch_sequences: int = 0  # samples per minibatch of the padded layout (constant_norm's B)
  logits_chunk: int = 0  # > 0: log-probs and entropy chunk by chunk, no [tokens, vocab] logits
  proximal_in_update: bool = False  # TIS over one minibatch and one epoch: the proximal log-probs are
  #                                   the update's own forward (stop-gradient), not a second forward
  zigzag_inputs: bool = False  # update batches are laid out zigzag over `sequence` (set with the mesh:
  #                              rl/step/program.py build_run, rl/step/aot.py), which splash's ring must be told

  @classmethod
  def from_config(cls, cfg, *, needs_critic: bool) -> "LossSpec":
    """Resolves cfg.rl / cfg.moe; raises ValueError naming a field whose value is unknown."""
    rl = cfg.rl
    if rl.policy_loss not in POLICY_LOSS_RATIOS:
      raise ValueError(f"rl.policy_loss={rl.policy_loss!r}; choose one of {sorted(POLICY_LOSS_RATIOS)}.")
    if rl.loss_agg not in AGGREGATIONS:
      raise ValueError(f"rl.loss_agg={rl.loss_agg!r}; choose one of {sorted(AGGREGATIONS)}.")
    if rl.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"rl.kl_estimator={rl.kl_estimator!r}; choose one of {sorted(KL_ESTIMATORS)}.")
    if rl.kl_coef < 0:
      raise ValueError(f"rl.kl_coef={rl.kl_coef} must be >= 0.")
    if rl.kl_in_reward and not rl.kl_coef:
      raise ValueError("rl.kl_in_reward=true needs rl.kl_coef > 0 (the weight of the per-token penalty).")
    if not 0.0 <= rl.clip_low < 1.0 or rl.clip_high < 0.0:
      raise ValueError(f"need 0 <= rl.clip_low < 1 and rl.clip_high >= 0, got {rl.clip_low}, {rl.clip_high}.")
    if rl.dual_clip != 0.0 and rl.dual_clip <= 1.0:
      raise ValueError(f"rl.dual_clip={rl.dual_clip} must be 0 (off) or greater than 1.")
    if rl.tis_level not in TIS_LEVELS:
      raise ValueError(f"rl.tis_level={rl.tis_level!r}; choose one of {TIS_LEVELS}.")
    if not rl.tis_cap >= 1.0:
      raise ValueError(f"rl.tis_cap={rl.tis_cap} must be >= 1 (an unchanged policy has ratio 1).")
    if cfg.attention.logits_chunk < 0:
      raise ValueError(f"attention.logits_chunk={cfg.attention.logits_chunk} must be >= 0 (0 = dense).")
    num_sequences = int(rl.prompts_per_step * rl.group_size)
    return cls(
        temperature=float(rl.temperature), ratio=POLICY_LOSS_RATIOS[rl.policy_loss],
        clip_low=float(rl.clip_low), clip_high=float(rl.clip_high), dual_clip=float(rl.dual_clip),
        loss_agg=rl.loss_agg, max_len=int(rl.max_new_tokens), entropy_coef=float(rl.entropy_coef),
        kl_coef=0.0 if rl.kl_in_reward else float(rl.kl_coef), kl_metric=bool(rl.kl_coef),
        kl_estimator=rl.kl_estimator, value_coef=float(rl.value_coef) if needs_critic else 0.0,
        value_clip=float(rl.value_clip), replay_routing=bool(rl.replay_routing),
        moe=cfg.moe.num_experts > 0 and cfg.moe.first_k_dense < cfg.model.num_layers,
        aux_loss_coef=float(cfg.moe.aux_loss_coef), z_loss_coef=float(cfg.moe.z_loss_coef),
        tis_level=rl.tis_level, tis_cap=float(rl.tis_cap), packed=bool(rl.pack_updates),
        num_sequences=num_sequences,
        minibatch_sequences=num_sequences // max(int(rl.num_minibatches), 1),
        logits_chunk=int(cfg.attention.logits_chunk),
        # One minibatch of one epoch is updated under the very parameters the proximal policy is
        # recomputed with, so the update's forward gives those log-probs (exactly, bar fusion order).
        # A critic needs that forward's values, and a KL penalty in the reward its log-probs, before it.
        proximal_in_update=(rl.tis_level != "none" and rl.epochs * rl.num_minibatches == 1
                            and not needs_critic and not rl.kl_in_reward))

  @property
  def critic(self) -> bool:
    return self.value_coef > 0

  def required_fields(self) -> tuple[str, ...]:
    """The optional UpdateBatch fields this objective reads."""
    needed = []
    if self.kl_metric:
      needed.append("ref_logprobs")
    if self.critic:
      needed += ["old_values", "returns"]
    if self.replay_routing and self.moe:
      needed.append("routing")
    if self.tis_level != "none":
      needed.append("behaviour_logprobs")
    if self.packed:
      needed.append("sequence_ids")
    return tuple(needed)

  def sequences(self, sequence_ids) -> Sequences | None:
    """The `Sequences` of a packed batch's sequence_ids; None for the padded layout."""
    if not self.packed:
      return None
    return Sequences(sequence_ids, self.num_sequences, max(self.minibatch_sequences, 1))

  def describe(self) -> str:
    terms = [f"policy ({self.ratio} ratio, {self.loss_agg})"]
    if self.kl_coef:
      terms.append(f"KL {self.kl_estimator} x {self.kl_coef}")
    elif self.kl_metric:
      terms.append("KL in the reward")
    if self.entropy_coef:
      terms.append(f"entropy x {self.entropy_coef}")
    if self.critic:
      terms.append(f"value x {self.value_coef}")
    if self.replay_routing and self.moe:
      terms.append("routing replay")
    if self.tis_level != "none":
      terms.append(f"{self.tis_level}-level TIS capped at {self.tis_cap}"
                   + (" (proximal log-probs from the update's forward)" if self.proximal_in_update else ""))
    if self.packed:
      terms.append("packed rows")
    return ", ".join(terms)
