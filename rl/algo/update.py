"""The policy (and critic) update: `make_update(spec, graphdef, tx, ...) -> update(state, batch, key)`.

One jitted call runs `epochs` passes over an `UpdateBatch` (rl/batches/handover.py), each split into
`num_minibatches` shuffled minibatches (sample reuse, as PPO does): `lax.scan` over epochs, then
over minibatches. The loss recomputes the log-probs of the sampled tokens under the current
parameters at the sampling temperature, replaying the rollout's MoE routes when
`spec.replay_routing`. Which loss terms are on is fixed by the frozen `losses.LossSpec`, and the batch
is checked against it (`UpdateBatch.check`) before the first call.

With `spec.logits_chunk > 0` (attention.logits_chunk, the knob SFT uses for the same memory
problem) the log-probs and entropies come chunk by chunk from the final hidden states
(train/chunked_loss.py), so [B, S, V] logits never exist; the KL estimators need only the sampled
tokens' log-probs. With `spec.packed` the batch is packed rows (rl/batches/packing.py) and every
per-sequence reduction goes by `batch.sequence_ids`; with `spec.tis_level` the policy loss is
weighted by truncated importance ratios of the proximal (`old_logprobs`) to the behaviour policy.

`make_logprob_fn` is the same forward without a gradient: reference log-probs, the critic's values
at rollout time, and the proximal log-probs that importance correction recomputes.

Axis legend: B sequences, S tokens (prediction-aligned: column s scores targets[:, s]), V vocab,
L MoE layers, K experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshrl.rl.algo import losses
from meshrl.rl.batches.handover import UpdateBatch
from meshrl.train import chunked_loss
from meshrl.train.state import TrainState, merge_batch_model, update_router_bias
from meshrl.train.stops import guarded_update


def target_logprobs(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
  """log p(targets[:, s] | tokens[:, :s+1]) at the sampling temperature: [B, S] float32."""
  scale = 1.0 if temperature == 0 else 1.0 / temperature
  return losses.logprobs_from_logits(logits.astype(jnp.float32) * scale, targets)


def policy_forward(model, batch: UpdateBatch, *, temperature: float, replay_routing: bool,
                   logits_chunk: int = 0, entropy: bool = False):
  """Forward over whole sequences -> (logp [B, S], entropy [B, S] or None, ModelOutput).

  Both at the sampling temperature; with `logits_chunk > 0` chunk by chunk from the hidden states
  (the ModelOutput then has no logits)."""
  routing = batch.routing if replay_routing else None
  if routing is not None:
    routing = jnp.swapaxes(routing, 0, 1)  # [L, B, S, K]
  kw = dict(positions=batch.positions, segment_ids=batch.segment_ids, routing=routing)
  scale = 1.0 if temperature == 0 else 1.0 / temperature
  if logits_chunk:
    out = model(batch.tokens, return_hidden=True, **kw)
    logp, ent = chunked_loss.chunked_token_stats(out.hidden, model.output_projection(), batch.targets,
                                                 chunk=logits_chunk, scale=scale, entropy=entropy)
    return logp, ent, out
  out = model(batch.tokens, **kw)
  ent = losses.entropy_from_logits(out.logits.astype(jnp.float32) * scale) if entropy else None
  return target_logprobs(out.logits, batch.targets, temperature), ent, out


def rl_loss(params, extra, graphdef, batch: UpdateBatch, spec: losses.LossSpec):
  """The RL objective on one minibatch -> (loss, metrics). Each term below has a header."""
  model = merge_batch_model(graphdef, params, extra, zigzag_inputs=spec.zigzag_inputs)
  logp, token_entropy, out = policy_forward(model, batch, temperature=spec.temperature,
                                            replay_routing=spec.replay_routing,
                                            logits_chunk=spec.logits_chunk, entropy=True)
  mask = batch.loss_mask
  sequences = spec.sequences(batch.sequence_ids)  # None unless packed rows
  agg = dict(loss_agg=spec.loss_agg, max_len=spec.max_len, sequences=sequences)
  # The proximal (old) policy: recomputed before the update, or this forward's own log-probs when the
  # update is one minibatch of one epoch (spec.proximal_in_update: the same parameters).
  old_logprobs = jax.lax.stop_gradient(logp) if spec.proximal_in_update else batch.old_logprobs
  # Truncated importance weights: proximal (old) vs behaviour (rollout) policy, constants.
  is_weights, metrics = None, {}
  if spec.tis_level != "none":
    is_weights, metrics = losses.truncated_is_weights(
        old_logprobs, batch.behaviour_logprobs, mask, level=spec.tis_level, cap=spec.tis_cap,
        sequences=sequences)
  # Policy: clipped surrogate (token ratio for PPO/GRPO, sequence ratio for GSPO), TIS-weighted.
  loss, policy_metrics = losses.policy_loss(
      logp, old_logprobs, batch.advantages, mask, clip_low=spec.clip_low,
      clip_high=spec.clip_high, dual_clip=spec.dual_clip, ratio=spec.ratio, is_weights=is_weights,
      **agg)
  metrics.update(policy_metrics)
  metrics["logprob_diff_max"] = jnp.max(jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp)
                                                                - old_logprobs), 0.0))
  # Entropy: a bonus when entropy_coef > 0, always a metric.
  entropy, entropy_metrics = losses.entropy_term(token_entropy, mask, **agg)
  if spec.entropy_coef:
    loss = loss - spec.entropy_coef * entropy
  metrics.update(entropy_metrics)
  # KL to the reference policy: a loss term, or only a metric when the KL is in the reward.
  if spec.kl_metric:
    kl, kl_metrics = losses.kl_loss(logp, batch.ref_logprobs, mask, kind=spec.kl_estimator, **agg)
    metrics.update(kl_metrics)
    if spec.kl_coef:
      loss = loss + spec.kl_coef * kl
  # Critic: clipped value loss on the value head.
  if spec.critic:
    value, value_metrics = losses.value_loss(out.values, batch.old_values, batch.returns, mask,
                                             clip=spec.value_clip, **agg)
    loss = loss + spec.value_coef * value
    metrics.update(value_metrics)
  # MoE balance: auxiliary load-balancing and router z-losses.
  if out.aux:
    loss = loss + spec.aux_loss_coef * out.aux["aux_loss"] + spec.z_loss_coef * out.aux["z_loss"]
    metrics.update(moe_aux_loss=out.aux["aux_loss"], expert_load=out.aux["expert_load"],
                   route_mismatch=out.aux["route_mismatch"],
                   moe_dropped_frac=out.aux["dropped_fraction"])  # slots over the capacity buffers
  metrics["loss"] = loss
  return loss, metrics


def _minibatches(batch: UpdateBatch, key: jax.Array, num: int) -> UpdateBatch:
  """Shuffles the B sequences and splits them: every leaf [B, ...] -> [num, B / num, ...]."""
  size = batch.num_sequences
  order = jax.random.permutation(key, size)
  return jax.tree.map(lambda x: x[order].reshape((num, size // num) + x.shape[1:]), batch)


COUNTS = ("skipped_minibatches", "nonfinite_minibatches", "expert_load")  # over every minibatch


def _update_metrics(per_minibatch: dict) -> dict:
  """[epochs, minibatches] metrics -> the update's: counts (COUNTS) averaged over every minibatch;
  measurements (loss, entropy, ratios, grad norm ...) over the minibatches that were applied only,
  NaN when none was (nothing was measured: rl/step/driver.py leaves such a value out of the record, where
  a 0 had been reported as an entropy), and `updated_minibatches`, the applied share. The *_first
  metrics are the first minibatch's of the first epoch (NaN when it was not applied)."""
  applied = per_minibatch.pop("applied")  # [epochs, minibatches]
  count = jnp.sum(applied)
  def measured(m):
    weights = applied.reshape(applied.shape + (1,) * (m.ndim - 2))
    return jnp.where(count > 0, jnp.sum(m * weights, axis=(0, 1)) / jnp.maximum(count, 1.0), jnp.nan)
  metrics = {k: jnp.mean(m, axis=(0, 1)) if k in COUNTS else measured(m) for k, m in per_minibatch.items()}
  metrics["updated_minibatches"] = jnp.mean(applied)
  first = {k: jnp.where(applied[0, 0] > 0, m[0, 0], jnp.nan) for k, m in per_minibatch.items()
           if k in ("ratio_mean", "logprob_diff_max", "clip_frac_low", "clip_frac_high")}
  metrics["ratio_mean_first"] = first["ratio_mean"]
  del metrics["logprob_diff_max"]  # a max is only meaningful on-policy, before any step
  metrics["logprob_diff_max_first"] = first["logprob_diff_max"]
  metrics["clip_frac_first"] = first["clip_frac_low"] + first["clip_frac_high"]
  return metrics


def make_update(spec: losses.LossSpec, graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *,
                batch_size: int, num_minibatches: int = 1, epochs: int = 1,
                aux_free_bias: bool = False, bias_update_rate: float = 0.0):
  """Returns jitted `update(state, batch: UpdateBatch, key) -> (state, metrics)`; the state is donated.

  metrics: every loss metric averaged over the applied minibatches of epochs x minibatches (NaN
  when none was applied; `_update_metrics`), `updated_minibatches`, `skipped_minibatches` and
  `nonfinite_minibatches` (shares of all), plus `ratio_mean_first` and `clip_frac_first` of the
  first minibatch of the first epoch (on-policy: ratio 1, nothing clipped, when the rollout's and
  the update's log-probs agree).

  Raises ValueError when `num_minibatches` does not divide `batch_size` sequences.
  """
  if num_minibatches < 1 or batch_size % num_minibatches:
    raise ValueError(f"rl.num_minibatches={num_minibatches} must divide the batch of "
                     f"{batch_size} sequences (rl.prompts_per_step * rl.group_size).")
  if epochs < 1:
    raise ValueError(f"rl.epochs={epochs} must be at least 1.")
  grad_fn = jax.grad(functools.partial(rl_loss, graphdef=graphdef, spec=spec), has_aux=True)

  def minibatch_step(state: TrainState, minibatch: UpdateBatch):
    grads, metrics = grad_fn(state.params, state.extra, batch=minibatch)
    # Two kinds of minibatch leave parameters and optimizer state exactly as they were:
    # - one without a single loss token (every group dropped by dynamic sampling): its only gradient
    #   is the MoE balance loss, which Adam would blow up to full-size steps on the router;
    # - one whose loss or gradient is not finite (NaN guard): applying it would poison the weights.
    has_tokens = jnp.any(minibatch.loss_mask)
    params, opt_state, grad_norm, finite = guarded_update(tx, state, grads, metrics["loss"], when=has_tokens)
    applied = has_tokens & finite
    metrics = {k: v if k == "expert_load" else jnp.where(applied, v, 0.0) for k, v in metrics.items()}
    metrics["grad_norm"] = jnp.where(applied, grad_norm, 0.0)
    metrics["applied"] = applied.astype(jnp.float32)
    metrics["skipped_minibatches"] = 1.0 - has_tokens.astype(jnp.float32)
    metrics["nonfinite_minibatches"] = 1.0 - finite.astype(jnp.float32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def update(state: TrainState, batch: UpdateBatch, key: jax.Array):
    def epoch(state: TrainState, epoch_key: jax.Array):
      return jax.lax.scan(minibatch_step, state, _minibatches(batch, epoch_key, num_minibatches))

    state, per_minibatch = jax.lax.scan(epoch, state, jax.random.split(key, epochs))
    metrics = _update_metrics(per_minibatch)
    if aux_free_bias and "expert_load" in metrics:
      state = state.replace(extra=update_router_bias(state.extra, metrics["expert_load"],
                                                     bias_update_rate))
    return state, metrics

  return jax.jit(update, donate_argnums=(0,))


def make_logprob_fn(graphdef: nnx.GraphDef, *, temperature: float, replay_routing: bool,
                    logits_chunk: int = 0, zigzag_inputs: bool = False):
  """Jitted `(params, extra, batch: UpdateBatch) -> (logp [B, S], values [B, S] or None)`: reference
  log-probs, the critic's values at rollout time, proximal log-probs (chunked when logits_chunk).
  zigzag_inputs: the batches are laid out zigzag over `sequence` (train/state.merge_batch_model)."""
  def logprob_fn(params, extra, batch: UpdateBatch):
    model = merge_batch_model(graphdef, params, extra, zigzag_inputs=zigzag_inputs)
    logp, _, out = policy_forward(model, batch, temperature=temperature, replay_routing=replay_routing,
                                  logits_chunk=logits_chunk)
    return logp, out.values
  return jax.jit(logprob_fn)
