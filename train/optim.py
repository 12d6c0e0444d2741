"""The optimizer from `cfg.optim`: a learning-rate schedule, global-norm clipping, the update rule and
gradient accumulation, as one `optax.GradientTransformation`.

  tx = make_optimizer(cfg.optim)                                    # RL updates
  tx = make_optimizer(cfg.optim, learning_rate=cfg.rl.sft_learning_rate)  # SFT warm start

Schedules (step = optimizer update, not micro-batch):
  warmup   lr = peak * step / warmup_steps for step < warmup_steps (starts at 0)
  constant peak afterwards
  cosine   peak -> end_lr_ratio * peak over decay_steps along a half cosine, then flat
  linear   peak -> end_lr_ratio * peak over decay_steps along a line, then flat
Weight decay (adamw) applies to every parameter: stacked layers make a norm's scale 2-D, so rank is
no guide to what a bias or norm is; keep `optim.weight_decay` small or 0 (the default).
"""

from __future__ import annotations

from typing import Callable

import optax


def _constant(peak: float, optim_cfg) -> optax.Schedule:
  del optim_cfg
  return optax.constant_schedule(peak)


def _cosine(peak: float, optim_cfg) -> optax.Schedule:
  return optax.cosine_decay_schedule(peak, max(int(optim_cfg.decay_steps), 1),
                                     alpha=float(optim_cfg.end_lr_ratio))


def _linear(peak: float, optim_cfg) -> optax.Schedule:
  return optax.linear_schedule(peak, peak * float(optim_cfg.end_lr_ratio),
                               max(int(optim_cfg.decay_steps), 1))


SCHEDULES: dict[str, Callable[[float, object], optax.Schedule]] = {
    "constant": _constant,
    "cosine": _cosine,
    "linear": _linear,
}


def _adamw(lr: optax.Schedule, c) -> optax.GradientTransformation:
  return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _adam(lr: optax.Schedule, c) -> optax.GradientTransformation:
  return optax.adam(lr, b1=c.b1, b2=c.b2, eps=c.eps)


def _sgd(lr: optax.Schedule, c) -> optax.GradientTransformation:
  del c
  return optax.sgd(lr)


def _adafactor(lr: optax.Schedule, c) -> optax.GradientTransformation:
  # Clipping is done by `grad_clip` before the rule; Adafactor's own update clipping stays at 1.
  return optax.adafactor(lr, weight_decay_rate=c.weight_decay or None)


OPTIMIZERS: dict[str, Callable[[optax.Schedule, object], optax.GradientTransformation]] = {
    "adamw": _adamw,
    "adam": _adam,
    "sgd": _sgd,
    "adafactor": _adafactor,
}


def check_optim(optim_cfg, *, learning_rate: float | None = None, field: str = "optim.learning_rate") -> None:
  """ValueError naming the optim.* field (or `field`, the peak rate's) whose value cannot train: a
  rate <= 0 (gradient ascent, or nothing), betas outside [0, 1), eps <= 0, negative decay or steps."""
  peak = optim_cfg.learning_rate if learning_rate is None else learning_rate
  if not peak > 0:
    raise ValueError(f"{field}={peak} must be positive (a rate <= 0 ascends the loss or does nothing).")
  if optim_cfg.name not in OPTIMIZERS:
    raise ValueError(f"optim.name={optim_cfg.name!r} is unknown; choose one of {sorted(OPTIMIZERS)}.")
  if optim_cfg.schedule not in SCHEDULES:
    raise ValueError(f"optim.schedule={optim_cfg.schedule!r} is unknown; choose one of {sorted(SCHEDULES)}.")
  for name in ("b1", "b2"):
    if not 0.0 <= optim_cfg[name] < 1.0:
      raise ValueError(f"optim.{name}={optim_cfg[name]} must lie in [0, 1).")
  for name, low, meaning in (("eps", None, "positive"), ("weight_decay", 0, ">= 0"), ("grad_clip", 0, ">= 0 (0 = off)"),
                             ("warmup_steps", 0, ">= 0"), ("decay_steps", 1, ">= 1"),
                             ("grad_accum_steps", 1, ">= 1")):
    value = optim_cfg[name]
    if not (value > 0 if low is None else value >= low):
      raise ValueError(f"optim.{name}={value} must be {meaning}.")
  if not 0.0 <= optim_cfg.end_lr_ratio <= 1.0:
    raise ValueError(f"optim.end_lr_ratio={optim_cfg.end_lr_ratio} must lie in [0, 1] (a fraction of the peak).")


def make_schedule(optim_cfg, *, learning_rate: float | None = None) -> optax.Schedule:
  """The learning rate as a function of the optimizer update count.

  Args:
    optim_cfg: the `optim` section (schedule, warmup_steps, decay_steps, end_lr_ratio,
      learning_rate).
    learning_rate: peak rate overriding `optim_cfg.learning_rate` (e.g. rl.sft_learning_rate).

  Raises:
    ValueError naming `optim.schedule` or `optim.warmup_steps` when they are unusable.
  """
  name = optim_cfg.schedule
  if name not in SCHEDULES:
    raise ValueError(f"optim.schedule={name!r} is unknown; choose one of {sorted(SCHEDULES)}.")
  warmup = int(optim_cfg.warmup_steps)
  if warmup < 0:
    raise ValueError(f"optim.warmup_steps={warmup} must be >= 0.")
  peak = float(optim_cfg.learning_rate if learning_rate is None else learning_rate)
  after = SCHEDULES[name](peak, optim_cfg)
  if not warmup:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(optim_cfg, *, learning_rate: float | None = None,
                   rate_field: str = "optim.learning_rate") -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) -> the rule of `optim.name` with `make_schedule`'s rate,
  wrapped in `optax.MultiSteps` when `optim.grad_accum_steps > 1`.

  With accumulation, `update` must be called once per micro-batch: the first k-1 calls return zero
  updates, the k-th applies the rule to the mean of the k gradients, so k micro-batches of n equal
  one batch of k * n for a loss that is a mean over examples. The schedule counts real updates.

  Raises:
    ValueError naming the optim.* field (`rate_field` for the peak rate) that `check_optim` refuses.
  """
  check_optim(optim_cfg, learning_rate=learning_rate, field=rate_field)
  clip, accum = float(optim_cfg.grad_clip), int(optim_cfg.grad_accum_steps)
  rule = OPTIMIZERS[optim_cfg.name](make_schedule(optim_cfg, learning_rate=learning_rate), optim_cfg)
  tx = optax.chain(optax.clip_by_global_norm(clip), rule) if clip else rule
  if accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=accum).gradient_transformation()
  return tx
