"""Bootstrapping hard tasks (issue 33): the pass-rate curriculum, the retries of unsolved prompts and
the bank of verified successes for rejection-sampling fine-tuning, as one object the RL step's
collect consults.

  bootstrap = Bootstrap.from_config(cfg)    # None when data.level_curriculum, rl.retry_unsolved, rl.rft_every are off
  examples = bootstrap.stream(examples)     # prompts at their domains' levels, retries first
  bootstrap.observe(round_examples, scored) # after each scored rollout round
  metrics.update(bootstrap.metrics())       # curriculum/*, retried_prompts, ...
  hooks = bootstrap_hooks(run)              # the driver's: rejection-sampling fine-tuning rounds

Both only change which prompts a round draws, never a round's size or the batch's shape, so they
compose with every estimator, loss, dynamic sampling, partial and asynchronous rollouts. The
curriculum is rl/envs/levels.LevelCurriculum, the retries rl/step/retry.UnsolvedRetry, the bank and
its SFT rounds rl/step/rft.RejectionFineTune (the rounds run as a driver hook, after a step's update);
`get_state` / `set_state` carry all three through a checkpoint.

Several hosts: each host observes its own block of groups for its retries, and every host's (domain,
level) outcomes for the curriculum (gathered), so every host keeps the same levels.

Axis legend: P prompts of a round, G group size, B = P * G samples.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax

from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs.levels import LevelCurriculum, generated_domains, governed_domains
from meshrl.rl.step.groups import shared_prompts
from meshrl.rl.step.retry import UnsolvedRetry
from meshrl.rl.step.rft import RejectionFineTune
from meshrl.sharding import hosts


def curriculum_from_config(cfg, shard: int = 0) -> LevelCurriculum | None:
  """data.level_curriculum's LevelCurriculum (None when ""), starting at the configured levels;
  `shard`: this host's index when hosts draw their own prompts (else 0)."""
  data = cfg.data
  if not data.level_curriculum.strip():
    return None
  available, start = generated_domains(cfg)
  families = governed_domains(data.level_curriculum, available, field="data.level_curriculum")
  if not families:  # "all" on a run of file rows alone
    return None
  held_out_by_split = data.eval_fraction > 0 and not cfg.eval.jsonl  # as rl/step/driver.train_source
  return LevelCurriculum(families, start=start, floor=data.level_curriculum_floor, top=data.level_curriculum_max,
                         promote_at=data.level_curriculum_promote, demote_at=data.level_curriculum_demote,
                         window=data.level_curriculum_window, seed=cfg.seed, shard=shard,
                         eval_fraction=data.eval_fraction if held_out_by_split else 0.0)


class Bootstrap:
  """A run's curriculum (or None) and unsolved-prompt retries (or None); see the module docstring."""

  def __init__(self, curriculum: LevelCurriculum | None, retry: UnsolvedRetry | None, group_size: int,
               rft: RejectionFineTune | None = None):
    self.curriculum, self.retry, self.group_size, self.rft = curriculum, retry, int(group_size), rft
    self.moves: list[str] = []

  @classmethod
  def from_config(cls, cfg, processes: int | None = None) -> "Bootstrap | None":
    """From data.level_curriculum*, rl.retry_unsolved / rl.retry_share and rl.rft_*; None when all are off.
    A round's retries: rl.retry_share of this host's prompts (at least 1)."""
    processes = jax.process_count() if processes is None else processes
    shared = shared_prompts(cfg, processes)
    curriculum = curriculum_from_config(cfg, shard=0 if shared or processes == 1 else jax.process_index())
    retry = None
    if cfg.rl.retry_unsolved:
      per_host = cfg.rl.prompts_per_step // (1 if shared else processes)
      retry = UnsolvedRetry(max_retries=cfg.rl.retry_unsolved,
                            per_round=max(1, int(cfg.rl.retry_share * per_host)))
    rft = RejectionFineTune.from_config(cfg)
    if curriculum is None and retry is None and rft is None:
      return None
    return cls(curriculum, retry, cfg.rl.group_size, rft)

  def stream(self, examples: Iterator[dict]) -> Iterator[dict]:
    """The step's prompts: queued retries (as the round allows), then `examples` relevelled."""
    fresh = examples if self.curriculum is None else map(self.curriculum.relevel, examples)
    return fresh if self.retry is None else self.retry.stream(fresh)

  def observe(self, examples: Sequence[dict], scored: ScoredBatch, *, mine: slice | None = None) -> None:
    """One scored round: `examples` are this host's groups' (or every group's, when they are as many
    as the round's groups; then `mine` says which of them this host drew, for its retries: default
    all), `scored` every host's samples [B] in process order."""
    groups = len(scored.correct) // self.group_size
    if not examples or not groups:
      return
    everywhere = len(examples) == groups
    solved = scored.correct.reshape(groups, self.group_size).max(axis=1) > 0
    if self.retry is not None:
      if everywhere:
        mine = mine or slice(0, groups)
        self.retry.observe(list(examples)[mine], solved[mine])
      else:
        self.retry.observe(examples, solved[hosts.own_block(groups)])
    if self.rft is not None:
      self.rft.observe(examples, scored)
    if self.curriculum is not None:
      cells = [[str(e.get("domain", "")), int(e.get("difficulty", 0))] for e in examples]
      cells = cells if everywhere else hosts.gather_objects(cells)
      per_sample = [cell for cell in cells for _ in range(self.group_size)]
      self.moves += self.curriculum.observe([c[0] for c in per_sample], [c[1] for c in per_sample],
                                            scored.correct)

  def metrics(self) -> dict:
    """This step's figures: curriculum levels and pass rates, its moves ("curriculum/moved": a
    line), the retries' counts."""
    out = {}
    if self.curriculum is not None:
      out.update(self.curriculum.metrics())
      if self.moves:
        out["curriculum/moved"] = ", ".join(self.moves)
      self.moves = []
    if self.retry is not None:
      out.update(self.retry.metrics())
    return out

  def get_state(self) -> dict:
    """JSON for the checkpoint (rl/step/driver.carried_state)."""
    return {**({"curriculum": self.curriculum.get_state()} if self.curriculum is not None else {}),
            **({"retry": self.retry.get_state()} if self.retry is not None else {}),
            **({"rft": self.rft.get_state()} if self.rft is not None else {})}

  def set_state(self, state: dict) -> None:
    if self.curriculum is not None and "curriculum" in state:
      self.curriculum.set_state(state["curriculum"])
    if self.retry is not None and "retry" in state:
      self.retry.set_state(state["retry"])
    if self.rft is not None and "rft" in state:
      self.rft.set_state(state["rft"])


def bootstrap_hooks(run) -> list:
  """The driver's hooks for `run`'s bootstrapping (rl/step/driver.train_steps runs them after each
  step, before evaluation): the rejection-sampling fine-tuning rounds when rl.rft_every > 0."""
  bootstrap = getattr(run, "bootstrap", None)
  return [bootstrap.rft] if bootstrap is not None and bootstrap.rft is not None else []
