"""Rejection-sampling fine-tuning on the run's own verified successes, interleaved with RL (issue 33).

  rft = RejectionFineTune.from_config(cfg)   # None when rl.rft_every is 0
  rft.observe(examples, scored)              # a scored round: its verified successes join the bank
  rft(step, run, metrics)                    # a driver hook: every rl.rft_every RL steps,
                                             # rl.rft_steps SFT steps on the bank

The rollouts' responses that the task's verifier accepted (ScoredBatch.correct > 0: the task reward
alone, not a shaped or model-scored one) are kept as SFT rows {"prompt", "answer": the response} in a
bank of the newest rl.rft_bank distinct (prompt, response) pairs. Every rl.rft_every RL steps the
policy takes rl.rft_steps supervised steps on packed batches of the bank (train/sft.py's step and
batches, rl.sft_batch_size rows of data.seq_len, at rl.rft_learning_rate with a fresh optimizer
state each time, so a resumed run repeats them exactly). The RL optimizer's state, step and the KL
reference are left as they were. Rejection sampling, then fine-tuning on the accepted samples: RFT
(Yuan et al. 2023, arXiv:2308.01825), STaR (Zelikman et al. 2022, arXiv:2203.14465), ReST (Gulcehre et
al. 2023, arXiv:2308.08998); here interleaved with the policy-gradient steps rather than alternated
with whole RL runs.

Multi-turn episodes: a row's answer is the episode after its prompt as the rollout decoded it, the
environment's observations included, so the SFT loss covers them too (train/sft.py has no per-turn
mask for bank rows yet; rl/step/episode_collect.Demonstrations cuts oracle episodes per turn instead).

A held-out prompt never enters the bank: prompts on the held-out side of data.eval_fraction's hash
split (when that split is the held-out set) and the prompts of eval.jsonl are refused at `observe`.

Several hosts: each host reads its own block of the round's groups and the banks are gathered, so
every host holds the same bank and draws its share of each SFT batch from it (train/data.py).

Axis legend: P prompts of a round, G group size, B = P * G samples.
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs.mixture import in_eval_split
from meshrl.sharding import hosts


def held_out_filter(cfg):
  """prompt -> True when it is held out: the eval side of the hash split (when the run holds its
  evaluation prompts out that way) or a prompt of eval.jsonl."""
  fraction = cfg.data.eval_fraction if cfg.data.eval_fraction > 0 and not cfg.eval.jsonl else 0.0
  listed = set()
  if cfg.eval.jsonl:
    from meshrl.rl.envs.prompts import JsonlSource  # pylint: disable=import-outside-toplevel
    listed = {e["prompt"] for e in JsonlSource(cfg.eval.jsonl, skip_bad=True, field="eval.jsonl")}
  return lambda prompt: prompt in listed or bool(fraction and in_eval_split(prompt, fraction))


class RejectionFineTune:
  """The bank of verified successes and the SFT rounds on it (see the module docstring).

  Args:
    every / steps: an SFT round of `steps` steps after every `every`-th RL step.
    capacity: the bank's size in distinct (prompt, response) pairs; the oldest leave first.
    learning_rate: the SFT rounds' peak rate (optim.* gives the rule and schedule).
    group_size: G.
    held_out: prompt -> True for prompts that must never be trained on (`held_out_filter`).
  """

  def __init__(self, *, every: int, steps: int, capacity: int, learning_rate: float, group_size: int,
               held_out=lambda prompt: False):
    if every < 1 or steps < 1 or capacity < 1:
      raise ValueError(f"rl.rft_every={every}, rl.rft_steps={steps} and rl.rft_bank={capacity} must be at "
                       "least 1.")
    self.every, self.steps, self.capacity = int(every), int(steps), int(capacity)
    self.learning_rate, self.group_size, self.held_out = float(learning_rate), int(group_size), held_out
    self.bank: collections.OrderedDict = collections.OrderedDict()  # (prompt, response) -> SFT row
    self._step_fn = None
    self.step_counts = {"rft_added": 0}

  @classmethod
  def from_config(cls, cfg) -> "RejectionFineTune | None":
    """rl.rft_every / rl.rft_steps / rl.rft_bank / rl.rft_learning_rate; None when rl.rft_every is 0."""
    if not cfg.rl.rft_every:
      return None
    return cls(every=cfg.rl.rft_every, steps=cfg.rl.rft_steps, capacity=cfg.rl.rft_bank,
               learning_rate=cfg.rl.rft_learning_rate, group_size=cfg.rl.group_size,
               held_out=held_out_filter(cfg))

  # --- the bank ---------------------------------------------------------------------------------

  def observe(self, examples: Sequence[dict], scored: ScoredBatch) -> None:
    """One scored round, as rl/step/bootstrap.Bootstrap.observe receives it: `examples` this host's
    groups' (or, as many as the round's groups, every group's), `scored` every host's samples [B].
    Its valid samples whose task reward is a success join the bank (every host the same rows)."""
    G = self.group_size
    groups = len(scored.correct) // G
    if not examples or not groups:
      return
    everywhere = len(examples) == groups  # every host holds every group's example
    block = slice(0, groups) if everywhere else hosts.own_block(groups)
    rows = []
    for g, example in zip(range(block.start, block.stop), examples):
      for i in range(g * G, (g + 1) * G):
        if scored.sample_valid[i] and scored.correct[i] > 0 and not self.held_out(example["prompt"]):
          rows.append([str(example["prompt"]), str(scored.texts[i])])
    for prompt, response in (rows if everywhere else hosts.gather_objects(rows)):
      self._add(prompt, response)

  def _add(self, prompt: str, response: str) -> None:
    key = (prompt, response)
    if key in self.bank:
      self.bank.move_to_end(key)
      return
    self.bank[key] = {"prompt": prompt, "answer": response}
    self.step_counts["rft_added"] += 1
    while len(self.bank) > self.capacity:
      self.bank.popitem(last=False)

  def rows(self) -> list[dict]:
    """The bank's SFT rows, oldest first."""
    return list(self.bank.values())

  # --- the SFT rounds -----------------------------------------------------------------------------

  def __call__(self, step: int, run, metrics: dict) -> None:
    """The driver hook: after RL step `step`, an SFT round when `step` is a multiple of rl.rft_every
    and the bank holds a row; adds rft_* figures to `metrics` (the step's record)."""
    metrics.update(self.metrics())
    if step % self.every or not self.bank:
      return
    metrics.update(self.fine_tune(run))

  def fine_tune(self, run) -> dict:
    """rl.rft_steps SFT steps of run.state's params (and router biases) on the bank; the RL
    optimizer's state and step stay. Rows longer than data.seq_len are left out (as the warm start
    skips them). Returns {"rft_loss": the round's mean cross-entropy, "rft_rows": rows trained on}."""
    # pylint: disable=import-outside-toplevel  (jax programs built on first use)
    from meshrl.sharding.rules import rules_from_config
    from meshrl.train.data import encode_example, make_sft_data
    from meshrl.train.optim import make_optimizer
    from meshrl.train.sft import batch_sharding, make_sft_step, put_batch
    from meshrl.train.state import TrainState, init_opt_state, shardings_of
    # pylint: enable=import-outside-toplevel
    cfg = run.cfg
    rows = [row for row in self.rows() if len(encode_example(row, run.tokenizer)["tokens"]) <= cfg.data.seq_len]
    if not rows:  # every one longer than an SFT row: nothing to train on (SFTData would search forever)
      return {"rft_rows": 0.0}
    tx = make_optimizer(cfg.optim, learning_rate=self.learning_rate, rate_field="rl.rft_learning_rate")
    state = TrainState(step=jnp.zeros_like(run.state.step), params=run.state.params,
                       opt_state=init_opt_state(tx, run.state.params, run.mesh), extra=run.state.extra)
    if self._step_fn is None:
      self._step_fn = make_sft_step(run.graphdef, run.mesh, cfg, tx, state_shardings=shardings_of(state))
    sharding = None if run.mesh is None else batch_sharding(run.mesh, rules_from_config(cfg.mesh))
    data = make_sft_data(cfg, source=rows, tokenizer=run.tokenizer)
    losses = []
    for _ in range(self.steps):
      state, step_metrics = self._step_fn(state, put_batch(next(data), sharding, run.zigzag_shards))
      losses.append(step_metrics["ce"])
    run.state = run.state.replace(params=state.params, extra=state.extra)
    return {"rft_loss": float(np.mean(jax.device_get(losses))), "rft_rows": float(len(rows))}

  # --- figures and the checkpoint -----------------------------------------------------------------

  def metrics(self) -> dict[str, float]:
    """This step's added rows and the bank's size; the step count restarts."""
    out = {"rft_added": float(self.step_counts["rft_added"]), "rft_bank": float(len(self.bank))}
    self.step_counts = {"rft_added": 0}
    return out

  def get_state(self) -> list[list[str]]:
    """JSON: the bank's (prompt, response) pairs, oldest first."""
    return [list(key) for key in self.bank]

  def set_state(self, state: list) -> None:
    self.bank = collections.OrderedDict(((p, r), {"prompt": p, "answer": r}) for p, r in state)
