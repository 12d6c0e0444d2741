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
compiled program serves every step. With several host processes each scores its own samples: every
call spans the mesh, each host filling and reading its own R / processes rows (`_launch`).

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
from meshrl.rl.rewards.pool import Dispatched, call_rows
from meshrl.sharding import hosts
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
    rows: R, rows per call; a multiple of the mesh's batch shards and of the host processes.
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
    if rows % jax.process_count():
      raise ValueError(f"reward-model rows={rows} per call do not split over {jax.process_count()} host processes.")
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
    """Starts the scoring calls without waiting -> [(scores [R] on the devices, this host's rows of
    the call that are real)]. JAX dispatch returns at once: the devices score while the host goes on.
    With several host processes every call spans the mesh: each host fills its own R / processes
    rows with its own samples (hosts.global_rows), and all make as many calls as the host with the
    most samples needs (hosts.calls_over_hosts; collective), a host with none included."""
    count = len(tokens)
    per_call, num_calls = hosts.calls_over_hosts(count, self.rows)
    if not count:  # no samples here, but this host still takes its part in every call: a BOS row
      tokens = np.full((1, self.row_len), self.tokenizer.pad_id, np.int32)
      tokens[0, 0] = self.tokenizer.pad_id if self.tokenizer.bos_id is None else self.tokenizer.bos_id
      lengths = np.ones(1, np.int32)
    shardings = row_shardings(self.mesh, self.rules) if self.mesh is not None else (None, None)
    calls = []
    for call in range(num_calls):
      index, real = call_rows(count, per_call, call)
      rows, row_lengths = (hosts.global_rows(x[index], sharding)
                           for x, sharding in zip((tokens, lengths), shardings))
      calls.append((self.score_fn(self.params, self.extra, rows, row_lengths), real))
    return calls

  @staticmethod
  def _read(calls: list[tuple[jax.Array, int]]) -> np.ndarray:
    """`_launch`'s calls -> this host's scores [N] float32 (waits for them; with several host
    processes, each reads its own rows of every call: hosts.share_to_host)."""
    out = [np.asarray(hosts.share_to_host(scores), np.float32)[:real] for scores, real in calls]
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
