"""A trained reward model as a batched reward source: every sample of a step scored in one jitted
program on the policy's mesh (train/reward_model.make_scorer), its parameters frozen and sharded by
the same rules as the policy's.

  scorer = RewardModelScorer(model, tokenizer, rows=R, row_len=T, mesh=mesh, rules=rules)
  scores, info = scorer(completions, examples)       # [N] float32 (N any; R rows per call)
  handle = scorer.dispatch(completions, examples)   # the same, started on the devices without waiting
  scores, info = scorer.finish(handle)

A sample's row is the one the reward model was trained on (train/preferences.encode_side): BOS, the
rendered prompt, the completion, EOS, right-padded to T; a longer row keeps its last T tokens (the
completion, its EOS and the end of the prompt: the score position stays) and is counted in
info["rm_truncated"]. Rows go R at a time (the last call padded by repeating its first row), so one
compiled program serves every step.

Length guards (reward hacking: a reward model that likes long answers is exploited by long answers):
`length_normalize` divides a score by the completion's token count, `length_penalty` then subtracts
that much per token (`length_guard`).

Axis legend: R rows per call (a multiple of the mesh's batch shards), T tokens per row.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.rewards.pool import Dispatched
from meshrl.sharding.rules import Rules
from meshrl.train.preferences import encode_side
from meshrl.train.reward_model import make_scorer, row_shardings


def length_guard(scores: np.ndarray, lengths: np.ndarray, *, penalty: float = 0.0,
                 normalize: bool = False) -> np.ndarray:
  """scores [N], lengths [N] (completion tokens) -> [N] float32: scores / max(lengths, 1) when
  `normalize`, then minus `penalty` * lengths."""
  scores = np.asarray(scores, np.float32)
  lengths = np.asarray(lengths, np.float32)
  if normalize:
    scores = scores / np.maximum(lengths, 1.0)
  return (scores - np.float32(penalty) * lengths).astype(np.float32)


class RewardModelScorer:
  """Scores completions with a reward model (a Transformer with its value head) on `mesh`.

  Args:
    model: the reward model (train/rm_source.load_reward_model), parameters already sharded.
    tokenizer: the policy's tokenizer (checked to be the reward model's by rm_source).
    rows: R, rows per call; a multiple of the mesh's batch shards.
    row_len: T, tokens per row (at most the reward model's model.max_seq_len).
    mesh, rules: where the rows lie (None: one device).
    length_penalty, length_normalize: the length guards (`length_guard`).
    threshold: rl.rm_binarize's (train/rm_calibration.py): a score above it is 1, any other 0, before
      the length guards; None: the scores as they are.
  """

  def __init__(self, model: nnx.Module, tokenizer: Tokenizer, *, rows: int, row_len: int, mesh=None,
               rules: Rules | None = None, length_penalty: float = 0.0, length_normalize: bool = False,
               threshold: float | None = None):
    if rows < 1 or row_len < 2:
      raise ValueError(f"reward-model rows={rows} must be >= 1 and row_len={row_len} >= 2 (BOS and EOS).")
    graphdef, self.params, self.extra = nnx.split(model, nnx.Param, ...)
    self.score_fn = make_scorer(graphdef, mesh, rules)
    self.tokenizer, self.rows, self.row_len, self.mesh, self.rules = tokenizer, rows, row_len, mesh, rules
    self.length_penalty, self.length_normalize = float(length_penalty), bool(length_normalize)
    self.threshold = threshold

  def encode(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (tokens [N, T] int32 right-padded, lengths [N] int32, rows cut to their last T tokens)."""
    tokens = np.full((len(completions), self.row_len), self.tokenizer.pad_id, np.int32)
    lengths = np.zeros(len(completions), np.int32)
    cut = 0
    for i, (completion, example) in enumerate(zip(completions, examples)):
      ids = encode_side(self.tokenizer, str(example["prompt"]), completion)
      if len(ids) > self.row_len:
        ids, cut = ids[-self.row_len:], cut + 1
      tokens[i, :len(ids)], lengths[i] = ids, len(ids)
    return tokens, lengths, cut

  def _launch(self, tokens: np.ndarray, lengths: np.ndarray) -> list[tuple[jax.Array, int]]:
    """Starts the scoring calls, R rows each, without waiting -> [(scores [R] on the devices, rows
    of the call that are real)]. JAX dispatch returns at once: the devices score while the host goes on."""
    calls = []
    for start in range(0, len(tokens), self.rows):
      part = np.arange(start, min(start + self.rows, len(tokens)))
      filled = np.concatenate([part, np.full(self.rows - len(part), part[0])])
      rows, row_lengths = tokens[filled], lengths[filled]
      if self.mesh is not None:
        tokens_sharding, rows_sharding = row_shardings(self.mesh, self.rules)
        rows = jax.make_array_from_process_local_data(tokens_sharding, rows)
        row_lengths = jax.make_array_from_process_local_data(rows_sharding, row_lengths)
      calls.append((self.score_fn(self.params, self.extra, rows, row_lengths), len(part)))
    return calls

  @staticmethod
  def _read(calls: list[tuple[jax.Array, int]]) -> np.ndarray:
    """`_launch`'s calls -> their scores [N] float32 on the host (waits for them)."""
    out = [np.asarray(jax.device_get(scores), np.float32)[:real] for scores, real in calls]
    return np.concatenate(out) if out else np.zeros(0, np.float32)

  def dispatch(self, completions: Sequence[str], examples: Sequence[dict]) -> Dispatched:
    """Encodes the rows and starts their scoring on the devices without waiting; `finish` reads the
    scores. The RL step dispatches a batch's scoring ahead of the next rollout (rl/step/program.py)."""
    tokens, lengths, cut = self.encode(completions, examples)
    return Dispatched(self._launch(tokens, lengths), list(completions), {"rm_truncated": cut})

  def finish(self, dispatched: Dispatched) -> tuple[np.ndarray, dict]:
    """`dispatch`'s scores -> (scores [N] float32 after the length guards, info {"errors": 0,
    "first_errors": [], "rm_truncated": rows cut to T})."""
    scores = self._read(dispatched.calls)
    completions = dispatched.completions
    if self.threshold is not None:  # rl.rm_binarize: right (1) above the calibrated threshold, else 0
      scores = (scores > self.threshold).astype(np.float32)
    if self.length_penalty or self.length_normalize:
      response = [len(self.tokenizer.encode(c, add_bos=False)) for c in completions]
      scores = length_guard(scores, np.asarray(response), penalty=self.length_penalty,
                            normalize=self.length_normalize)
    return scores, {"errors": 0, "first_errors": [], **dispatched.info}

  def __call__(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[np.ndarray, dict]:
    """`finish(dispatch(...))`: the scores at once."""
    return self.finish(self.dispatch(completions, examples))
