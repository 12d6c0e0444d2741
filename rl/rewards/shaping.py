"""Reward shaping on response lengths (host side, numpy)."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, *, max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
  """DAPO overlong shaping (Yu et al. 2025, arXiv:2503.14476), in tokens.

  0 up to `max_len - buffer` tokens, then a linear ramp down to `-penalty` at `max_len` and
  beyond.

  Args:
    lengths: [N] response lengths in tokens.
    max_len: response budget (cfg.rl.max_new_tokens).
    buffer: ramp length (cfg.rl.overlong_buffer); 0 turns the shaping off.
    penalty: penalty at the budget (cfg.rl.overlong_penalty).

  Returns:
    [N] float32 penalties (<= 0), to add to the rewards.
  """
  if buffer < 0 or buffer > max_len:
    raise ValueError(f"overlong buffer={buffer} must lie in [0, max_len={max_len}].")
  lengths = np.asarray(lengths, np.float32)
  if buffer == 0:
    return np.zeros_like(lengths)
  over = np.clip(lengths - (max_len - buffer), 0.0, buffer)
  return (-penalty * over / buffer).astype(np.float32)
