"""The frozen numbers of one generator: what every scheduler and proposer of rl/generation/ reads.

Built once from a run's config (rl/step/spec.py) or by a caller that knows its numbers (the server, a
script); checked when built, so a generator that exists can run.
"""

from __future__ import annotations

import dataclasses

from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.loop import SCHEDULERS
from meshrl.rl.generation.tiers import check_host_budget
from meshrl.rl.generation.weights import WeightsSpec


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
  """One generator.

  step: the decode step (sampler, stops, proposer, turn rules); group_size: samples per prompt;
  prompt_len: Lp, the prompt columns; max_new_tokens: policy tokens per sample (a multi-turn
  episode's budget); width: buffer columns after the prompt (N: the response, or an episode's turns
  and observations); scheduler: static | continuous | budgeted | episodic; slots: decode slots (0: one
  per sample); token_budget: the budgeted scheduler's slot-steps per call; extension: the longest
  extension (an observation), the caches' slack; chunk_steps: decode steps between the host's looks
  (episodic); barrier: turn-synchronous episodes (the static multi-turn rollout); prefill_chunk:
  prompts prefilled in chunks of that many tokens, between the other slots' decode steps (0: one
  pass; rl.prefill_chunk); kv_host_bytes: the KV cache's host tier for paused episodes (0: none;
  rl.kv_host_bytes, rl/generation/tiers.py)."""
  step: StepConfig
  group_size: int
  prompt_len: int
  max_new_tokens: int
  width: int = 0
  scheduler: str = "static"
  slots: int = 0
  token_budget: int = 0
  weights: WeightsSpec = WeightsSpec()
  extension: int = 0
  chunk_steps: int = 8
  barrier: bool = False
  prefill_chunk: int = 0
  kv_host_bytes: int = 0

  def __post_init__(self):
    chunk = self.prefill_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
      raise ValueError(f"rl.prefill_chunk={chunk!r} must be a whole number of tokens >= 1 (0 = one-pass prefill).")
    check_host_budget(self.kv_host_bytes)
    if self.scheduler not in SCHEDULERS:
      raise ValueError(f"generation scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}.")
    for name in ("group_size", "prompt_len", "max_new_tokens", "chunk_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"generation {name}={getattr(self, name)} must be at least 1.")
    if self.slots < 0:
      raise ValueError(f"rl.decode_slots={self.slots} must be >= 0 (0 = one slot per sample).")
    if self.token_budget < 0:
      raise ValueError(f"rl.rollout_token_budget={self.token_budget} must be >= 0 (0 = off).")
    if self.width and self.width < self.max_new_tokens:
      raise ValueError(f"generation width={self.width} is less than max_new_tokens={self.max_new_tokens}.")

  @property
  def columns(self) -> int:
    """N, the buffer columns after the prompt."""
    return self.width or self.max_new_tokens

  @property
  def cache_len(self) -> int:
    """Cache columns: prompt + N, and room past a sample's last column for the writes that start
    there: a speculative window's k proposals, or the longest extension padded to its bucket."""
    return self.prompt_len + self.columns + max(self.step.proposer.window, self.extension)

  def num_slots(self, num_samples: int) -> int:
    """rl.decode_slots (0 = one slot per sample), capped at the number of samples."""
    return num_samples if self.slots == 0 else min(self.slots, num_samples)

  def max_steps(self, num_samples: int) -> int:
    """Decode steps one budgeted call may take: token_budget // slots (0: unbounded)."""
    return self.token_budget // self.num_slots(num_samples) if self.token_budget else 0
