"""The NaN guard: a step whose loss or gradient is not finite is not applied, and a run whose steps
keep failing stops with a checkpoint and a clear message.

  finite = step_is_finite(loss, grad_norm)                      # inside the jitted step
  params, opt_state = keep_unless(finite, (new_params, new_opt), (params, opt_state))
  streak = NonFiniteStreak(limit=cfg.rl.max_nonfinite_steps)    # in the host loop
  if streak.update(all_nonfinite):  -> save, then raise streak.error(...)

Used by the RL update (rl/algo/update.py, per minibatch; rl/step/driver.py counts steps in which every minibatch
was skipped) and by SFT (train/sft.py). A skipped step leaves parameters and optimiser state
bit-identical (a select, not a zero update: Adam's moments and count do not move either).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class NonFiniteError(RuntimeError):
  """Raised when `limit` steps in a row had a non-finite loss or gradient (none of them applied)."""


def step_is_finite(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
  """[] bool: the step may be applied (both the loss and the global gradient norm are finite)."""
  return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def keep_unless(apply: jax.Array, new, old):
  """`new` where `apply` ([] bool) else `old`, leaf by leaf (pytrees of the same structure)."""
  return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def guarded_update(tx, state, grads, loss: jax.Array, when: jax.Array | None = None):
  """One optimiser step that a non-finite loss or gradient leaves undone.

  Args:
    tx: the optax transformation; state: a TrainState (params, opt_state); grads: like state.params;
    loss: [] the step's loss; when: [] bool, a further condition for applying the step (None: always).
  Returns:
    (params, opt_state, grad_norm [], finite [] bool): the updated pair where `finite` (and `when`),
    else the old.
  """
  import optax  # pylint: disable=import-outside-toplevel  (keeps this module light for host code)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  finite = step_is_finite(loss, grad_norm)
  apply = finite if when is None else when & finite
  params, opt_state = keep_unless(apply, (params, opt_state), (state.params, state.opt_state))
  return params, opt_state, grad_norm, finite


class NonFiniteStreak:
  """Counts consecutive steps that were skipped as non-finite (host side).

  Args:
    limit: stop after this many in a row (0 = never stop).
    what: the loop's name for its steps in messages ("RL", "SFT").
    field: the config field that sets `limit`, named in the message.
  """

  def __init__(self, limit: int, *, what: str, field: str):
    self.limit, self.what, self.field = int(limit), what, field
    self.streak = 0

  def update(self, skipped: bool) -> bool:
    """Records one step; True when the streak has reached the limit (the run must stop)."""
    self.streak = self.streak + 1 if skipped else 0
    return bool(self.limit and self.streak >= self.limit)

  def error(self, step: int, saved: bool) -> NonFiniteError:
    where = (f"saved in the checkpoint of step {step}" if saved
             else "not saved (checkpointing is disabled)")
    return NonFiniteError(
        f"{self.streak} {self.what} steps in a row (up to step {step}) had a non-finite loss or "
        f"gradient; none was applied, the parameters are those of step {step - self.streak}, {where} "
        f"({self.field}={self.limit}).")
