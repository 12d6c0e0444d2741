"""The policy (and critic) update: `make_update(cfg, mesh, graphdef, tx) -> update(state, batch, key)`.

One jitted call runs `rl.epochs` passes over a rollout batch, each split into `rl.num_minibatches`
shuffled minibatches (sample reuse, as PPO does): `lax.scan` over epochs, then over minibatches.
The loss recomputes the log-probs of the sampled tokens under the current parameters; the reference
policy's log-probs are computed only when a KL term is on (`rl.kl_coef > 0`).

Batch (a dict of arrays, every leaf with the sequence axis B first):
  tokens, positions, segment_ids [B, S] int32; response_mask [B, S] bool; old_logprobs [B, S];
  advantages [B] (outcome estimators) or [B, S] (GAE); optional: ref_logprobs [B, S],
  old_values [B, S] and returns [B, S] (critic), routing [B, L, S, K] (MoE routing replay).

Axis legend: B sequences, S tokens, V vocab, L MoE layers, K experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshrl.rl import losses
from meshrl.train.state import TrainState, update_router_bias


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
  """log p(tokens[:, s] | tokens[:, :s]) aligned to position s: [B, S] (0 at s = 0)."""
  scale = 1.0 if temperature == 0 else 1.0 / temperature
  logp = losses.logprobs_from_logits(logits[:, :-1].astype(jnp.float32) * scale, tokens[:, 1:])
  return jnp.pad(logp, ((0, 0), (1, 0)))


def sequence_logprobs(model, batch: dict, *, temperature: float, replay_routing: bool):
  """Forward over whole sequences -> (logp [B, S], logits [B, S, V], ModelOutput)."""
  routing = batch.get("routing") if replay_routing else None
  if routing is not None:
    routing = jnp.swapaxes(routing, 0, 1)  # [L, B, S, K]
  out = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
              routing=routing)
  return token_logprobs(out.logits, batch["tokens"], temperature), out


def rl_loss(params, extra, graphdef, batch: dict, rl_cfg, moe_cfg):
  """The RL objective on one minibatch -> (loss, metrics). Each term below has a header."""
  model = nnx.merge(graphdef, params, extra)
  logp, out = sequence_logprobs(model, batch, temperature=rl_cfg.temperature,
                                replay_routing=rl_cfg.replay_routing)
  mask = batch["response_mask"]
  agg = dict(loss_agg=rl_cfg.loss_agg, max_len=rl_cfg.max_new_tokens)
  # Policy: clipped surrogate (token ratio for PPO/GRPO, sequence ratio for GSPO).
  loss, metrics = losses.policy_loss(
      logp, batch["old_logprobs"], batch["advantages"], mask, clip_low=rl_cfg.clip_low,
      clip_high=rl_cfg.clip_high, dual_clip=rl_cfg.dual_clip,
      ratio=losses.POLICY_LOSS_RATIOS[rl_cfg.policy_loss], **agg)
  # Entropy: a bonus when entropy_coef > 0, always a metric.
  scaled = out.logits.astype(jnp.float32) / (rl_cfg.temperature or 1.0)
  entropy, entropy_metrics = losses.entropy_loss(jnp.pad(scaled[:, :-1], ((0, 0), (1, 0), (0, 0))),
                                                 mask, **agg)
  loss = loss - rl_cfg.entropy_coef * entropy
  metrics.update(entropy_metrics)
  # KL to the reference policy, in the loss (with kl_in_reward it went into the rewards instead).
  if "ref_logprobs" in batch:
    kl, kl_metrics = losses.kl_loss(logp, batch["ref_logprobs"], mask, kind=rl_cfg.kl_estimator, **agg)
    metrics.update(kl_metrics)
    if not rl_cfg.kl_in_reward:
      loss = loss + rl_cfg.kl_coef * kl
  # Critic: clipped value loss on the value head.
  if "returns" in batch:
    value, value_metrics = losses.value_loss(out.values, batch["old_values"], batch["returns"], mask,
                                             clip=rl_cfg.value_clip, **agg)
    loss = loss + rl_cfg.value_coef * value
    metrics.update(value_metrics)
  # MoE balance: auxiliary load-balancing and router z-losses.
  if out.aux:
    loss = loss + moe_cfg.aux_loss_coef * out.aux["aux_loss"] + moe_cfg.z_loss_coef * out.aux["z_loss"]
    metrics.update(moe_aux_loss=out.aux["aux_loss"], expert_load=out.aux["expert_load"])
  metrics["loss"] = loss
  return loss, metrics


def _minibatches(batch: dict, key: jax.Array, num: int) -> dict:
  """Shuffles the B sequences and splits them: every leaf [B, ...] -> [num, B / num, ...]."""
  size = jax.tree.leaves(batch)[0].shape[0]
  order = jax.random.permutation(key, size)
  return jax.tree.map(lambda x: x[order].reshape((num, size // num) + x.shape[1:]), batch)


def make_update(cfg, graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
  """Returns jitted `update(state, batch, key) -> (state, metrics)`; the state is donated.

  Raises ValueError when the batch of prompts_per_step * group_size sequences does not split into
  rl.num_minibatches.
  """
  rl_cfg, moe_cfg = cfg.rl, cfg.moe
  batch_size = rl_cfg.prompts_per_step * rl_cfg.group_size
  if rl_cfg.num_minibatches < 1 or batch_size % rl_cfg.num_minibatches:
    raise ValueError(f"rl.num_minibatches={rl_cfg.num_minibatches} must divide the batch of "
                     f"{batch_size} sequences (rl.prompts_per_step * rl.group_size).")
  if rl_cfg.policy_loss not in losses.POLICY_LOSS_RATIOS:
    raise ValueError(f"rl.policy_loss={rl_cfg.policy_loss!r}; choose one of "
                     f"{sorted(losses.POLICY_LOSS_RATIOS)}.")
  grad_fn = jax.grad(functools.partial(rl_loss, graphdef=graphdef, rl_cfg=rl_cfg, moe_cfg=moe_cfg),
                     has_aux=True)

  def minibatch_step(state: TrainState, minibatch: dict):
    grads, metrics = grad_fn(state.params, state.extra, batch=minibatch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def update(state: TrainState, batch: dict, key: jax.Array):
    def epoch(state: TrainState, epoch_key: jax.Array):
      minibatches = _minibatches(batch, epoch_key, rl_cfg.num_minibatches)
      return jax.lax.scan(minibatch_step, state, minibatches)

    state, metrics = jax.lax.scan(epoch, state, jax.random.split(key, rl_cfg.epochs))
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=(0, 1)), metrics)  # over epochs x minibatches
    if cfg.moe.aux_free_bias and "expert_load" in metrics:
      state = state.replace(extra=update_router_bias(state.extra, metrics["expert_load"],
                                                     cfg.moe.bias_update_rate))
    return state, metrics

  return jax.jit(update, donate_argnums=(0,))


def make_logprob_fn(cfg, graphdef: nnx.GraphDef):
  """Jitted `(params, extra, batch) -> (logp [B, S], values [B, S] or None)`: reference log-probs,
  and the critic's values at rollout time."""
  def logprob_fn(params, extra, batch):
    model = nnx.merge(graphdef, params, extra)
    logp, out = sequence_logprobs(model, batch, temperature=cfg.rl.temperature,
                                  replay_routing=cfg.rl.replay_routing)
    return logp, out.values
  return jax.jit(logprob_fn)
