"""Vocabulary projection + cross-entropy in token chunks, so [tokens, vocab] logits never exist.

At 1M tokens a [tokens, vocab] float32 logit matrix alone is 0.5 TB (V = 128K); even per device it
dominates memory (../shared/research/long_context.md, section 7). Here a `lax.scan` walks over
chunks of tokens; each step projects one chunk to logits, reduces them to per-token numbers and
drops them, and `jax.checkpoint` makes the backward recompute that chunk's logits instead of saving
them. Peak extra memory is one chunk's logits: B * chunk * V floats.

Chunks are interleaved (chunk c holds positions c, c + C, c + 2C, ... of every row, C = T / chunk),
so when the length axis is sharded over `sequence` every chunk is spread evenly over the devices and
the scan never gathers a sharded axis.

`chunked_cross_entropy` serves SFT; `chunked_token_stats` (log-probs of the sampled tokens at a
temperature, and the entropy of each next-token distribution) serves the RL update, whose policy
loss, KL (sampled-token estimators) and entropy need nothing else from the logits.

Axis legend: B batch, T length, D model width, V vocabulary, C number of chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _to_chunks(x, chunk: int, pad_value=0):
  """[B, T, ...] -> [C, B, chunk, ...] with chunk c holding positions c, c + C, ...; T padded."""
  b, t = x.shape[:2]
  n_chunks = -(-t // chunk)
  if n_chunks * chunk != t:
    widths = [(0, 0), (0, n_chunks * chunk - t)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, widths, constant_values=pad_value)
  x = x.reshape((b, chunk, n_chunks) + x.shape[2:])  # [B, chunk, C, ...]
  return jnp.moveaxis(x, 2, 0)  # [C, B, chunk, ...]


def _from_chunks(x, t: int):
  """[C, B, chunk] -> [B, T]: the inverse of `_to_chunks` (padding dropped)."""
  n_chunks, b, chunk = x.shape
  return jnp.moveaxis(x, 0, 2).reshape(b, n_chunks * chunk)[:, :t]


def _check(hidden, head, targets, chunk):
  if hidden.ndim != 3 or head.ndim != 2 or targets.shape != hidden.shape[:2]:
    raise ValueError(f"expected hidden [B, T, D], head [D, V], targets [B, T]; got hidden "
                     f"{hidden.shape}, head {head.shape}, targets {targets.shape}.")
  if head.shape[0] != hidden.shape[-1]:
    raise ValueError(f"head {head.shape} must be [D, V] with D = hidden width {hidden.shape[-1]} "
                     "(pass a tied [V, D] embedding as embedding.T).")
  if chunk < 1:
    raise ValueError(f"chunk={chunk} must be at least 1.")


def _token_logprobs(hidden_chunk, head, target_chunk):
  """log p(target) [B, chunk] float32 for one chunk; the chunk's logits live only in here."""
  logits = jnp.einsum("BTD,DV->BTV", hidden_chunk, head, preferred_element_type=jnp.float32)
  target_chunk = jnp.clip(target_chunk, 0, logits.shape[-1] - 1)  # ignored ids (e.g. -100) stay finite
  target_logit = jnp.take_along_axis(logits, target_chunk[..., None], axis=-1)[..., 0]
  return target_logit - jax.nn.logsumexp(logits, axis=-1)


def chunked_logprobs(hidden, head, targets, *, chunk: int):
  """Per-token log-probabilities of the targets, without materialising all logits.

  Args:
    hidden: [B, T, D] final hidden states (after the last norm).
    head: [D, V] output projection (a tied embedding [V, D] goes in as `embedding.T`).
    targets: [B, T] int token ids to score.
    chunk: tokens per row per scan step; the peak logit buffer is [B, chunk, V] float32.

  Returns:
    [B, T] float32 log p(targets[b, t] | hidden[b, t]).
  """
  _check(hidden, head, targets, chunk)
  chunk = min(chunk, hidden.shape[1])

  @jax.checkpoint
  def step(_, xs):
    hidden_chunk, target_chunk = xs
    return None, _token_logprobs(hidden_chunk, head, target_chunk)

  with jax.named_scope("chunked_logprobs"):
    _, logprobs = jax.lax.scan(step, None, (_to_chunks(hidden, chunk), _to_chunks(targets, chunk)))
  return _from_chunks(logprobs, hidden.shape[1])


def _token_stats(hidden_chunk, head, target_chunk, scale: float, with_entropy: bool):
  """(log p(target), entropy) [B, chunk] float32 of one chunk's logits * scale, formed only here."""
  logits = jnp.einsum("BTD,DV->BTV", hidden_chunk, head, preferred_element_type=jnp.float32) * scale
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  target_chunk = jnp.clip(target_chunk, 0, logits.shape[-1] - 1)
  logp = jnp.take_along_axis(log_probs, target_chunk[..., None], axis=-1)[..., 0]
  if not with_entropy:
    return logp, jnp.zeros_like(logp)
  probs = jnp.exp(log_probs)
  return logp, -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)


def chunked_token_stats(hidden, head, targets, *, chunk: int, scale: float = 1.0,
                        entropy: bool = True):
  """Per-token log-probs of the targets and entropies under softmax(logits * scale), chunk by chunk.

  Equal to the dense `log_softmax(hidden @ head * scale)` computation, gradients included (the
  backward recomputes one chunk's logits at a time).

  Args:
    hidden: [B, T, D] final hidden states (after the last norm).
    head: [D, V] output projection (a tied embedding [V, D] goes in as `embedding.T`).
    targets: [B, T] int token ids to score.
    chunk: tokens per row per scan step; the peak logit buffer is [B, chunk, V] float32.
    scale: multiplies the logits (1 / sampling temperature).
    entropy: also compute the entropies (else None is returned for them).

  Returns:
    (logp [B, T] float32, entropy [B, T] float32 or None).
  """
  _check(hidden, head, targets, chunk)
  chunk = min(chunk, hidden.shape[1])

  @jax.checkpoint
  def step(_, xs):
    hidden_chunk, target_chunk = xs
    return None, _token_stats(hidden_chunk, head, target_chunk, scale, entropy)

  with jax.named_scope("chunked_token_stats"):
    _, (logp, ent) = jax.lax.scan(step, None, (_to_chunks(hidden, chunk), _to_chunks(targets, chunk)))
  t = hidden.shape[1]
  return _from_chunks(logp, t), (_from_chunks(ent, t) if entropy else None)


def chunked_cross_entropy(hidden, head, targets, mask, *, chunk: int):
  """Summed token cross-entropy and token count, without materialising all logits.

  Args:
    hidden: [B, T, D] final hidden states.
    head: [D, V] output projection (a tied embedding [V, D] goes in as `embedding.T`).
    targets: [B, T] int target ids.
    mask: [B, T] bool or float weights (0 = ignore the token).
    chunk: tokens per row per scan step; the peak logit buffer is [B, chunk, V] float32.

  Returns:
    (loss_sum, weight_sum): float32 scalars, sum of mask * -log p(target) and of mask; the mean
    loss is loss_sum / max(weight_sum, 1).
  """
  _check(hidden, head, targets, chunk)
  if mask.shape != targets.shape:
    raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}.")
  chunk = min(chunk, hidden.shape[1])
  weights = mask.astype(jnp.float32)

  @jax.checkpoint
  def step(loss_sum, xs):
    hidden_chunk, target_chunk, weight_chunk = xs
    nll = -_token_logprobs(hidden_chunk, head, target_chunk)
    return loss_sum + jnp.sum(nll * weight_chunk), None

  with jax.named_scope("chunked_cross_entropy"):
    loss_sum, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32),
                               (_to_chunks(hidden, chunk), _to_chunks(targets, chunk),
                                _to_chunks(weights, chunk)))
  return loss_sum, jnp.sum(weights)
