"""Held-out evaluation of a policy: greedy accuracy, pass@k and response length, per domain.

The held-out prompts come from the other side of the training mixture's hash split (data.tasks and
the data.jsonl / data.array_record rows: rl/step/sources.task_mixture(split="eval"), disjoint from
every training prompt by construction) or from a JSONL file (eval.jsonl), which is refused when it
shares a prompt with the training data.

  evaluator = Evaluator(cfg, mesh, tokenizer, examples)
  metrics = evaluator(params, extra)   # {"eval/accuracy": ..., "eval/accuracy/<domain>": ..., ...}

Greedy decoding runs the same jitted rollout as training with one sample per prompt at temperature
0; pass@k samples k per prompt at rl.temperature (the unbiased estimator of Chen et al. 2021,
arXiv:2107.03374, with n = k samples is "any of the k is correct").
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.step.groups import next_prompts, response_columns
from meshrl.rl.envs import distinct_examples
from meshrl.rl.envs.prompts import JsonlSource
from meshrl.rl.rewards import answer_reward
from meshrl.rl.batches.rows import rollout_rows
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.rewards.sources import domain_sources, reward_model_scorer
from meshrl.rl.step.sources import task_mixture
from meshrl.rl.step.spec import make_generator
from meshrl.sharding import hosts
from meshrl.sharding.rules import data_parallel_size


def held_out_examples(cfg, *, train_prompts: Sequence[str] = (), report: Callable[[str], None] = print,
                      pools: dict | None = None) -> list[dict]:
  """eval.num_prompts held-out examples with distinct prompts: from eval.jsonl, else from the
  held-out side of the data.domains registry (every domain), else of the training mixture (data.tasks
  with data.jsonl / data.array_record and the multi-turn families: rl/step/sources.task_mixture;
  fewer when it has fewer distinct prompts there). `pools`: the training mixture's (TaskMixture.pools),
  so that its files are not read again.

  eval.jsonl's rows are read as training data's are (rl/envs/prompts.JsonlSource): malformed rows are
  skipped and `report`ed in one line naming file and line (data.skip_bad_rows=false: refused), and a
  file without a valid row is refused.

  Raises ValueError naming the file when eval.jsonl shares a prompt with `train_prompts`, has no
  valid row, or (data.skip_bad_rows=false) has a malformed one.
  """
  if cfg.eval.jsonl:
    source = JsonlSource(cfg.eval.jsonl, skip_bad=cfg.data.skip_bad_rows, field="eval.jsonl")
    if source.bad:
      shown = "; ".join(f"{b.file}:{b.line}: {b.reason}" for b in source.bad[:3])
      report(f"eval.jsonl: skipped {len(source.bad)} malformed rows of {len(source) + len(source.bad)} "
             f"({shown}{'; ...' if len(source.bad) > 3 else ''}); evaluating the {len(source)} valid ones")
    examples = list(source)
    overlap = sorted(set(e["prompt"] for e in examples) & set(train_prompts))
    if overlap:
      raise ValueError(f"eval.jsonl={cfg.eval.jsonl!r} shares {len(overlap)} prompt(s) with the training "
                       f"data, e.g. {overlap[0]!r}; held-out prompts must be disjoint.")
    return distinct_examples(examples, cfg.eval.num_prompts, max_draws=len(examples))
  if cfg.data.domains:  # the registry's domains, each on the held-out side of its hash split
    from meshrl.rl.envs.quality import Quarantine  # pylint: disable=import-outside-toplevel
    from meshrl.rl.envs.registry import held_out_from_file  # pylint: disable=import-outside-toplevel
    return held_out_from_file(cfg.data.domains, count=cfg.eval.num_prompts, seed=cfg.seed + 7919,
                              eval_fraction=cfg.data.eval_fraction,
                              quarantine=Quarantine(cfg.data.quarantine))
  return distinct_examples(task_mixture(cfg, split="eval", seed=cfg.seed + 7919, pools=pools),
                           cfg.eval.num_prompts)


class Evaluator:
  """Greedy (and pass@k) evaluation of `examples` on the run's mesh; compiled on first call.

  Args:
    cfg: the run config (rl.* for the rollout, eval.* for sizes).
    mesh: the run's mesh (None: one device).
    tokenizer: the run's tokenizer.
    examples: held-out examples (each with "prompt", "answer" and optionally "domain").
    rm_scorer: the run's reward model (rl/rewards/rm_scorer.py) when a domain of rl.reward_sources uses
      one: the greedy completions' mean score is eval/rm_score beside the verifier's eval/accuracy
      (a policy that games the reward model raises the one and not the other). None: loaded here
      when rl.reward_sources uses a reward model (a second copy of its parameters; pass the run's).
  """

  def __init__(self, cfg, mesh, tokenizer: Tokenizer, examples: list[dict], *, rm_scorer=None):
    if not examples:
      raise ValueError("evaluation has no held-out examples (eval.num_prompts, data.eval_fraction).")
    self.cfg, self.tokenizer, self.examples = cfg, tokenizer, list(examples)
    shards = data_parallel_size(mesh.shape) if mesh is not None else 1
    self.batch = -(-min(cfg.eval.batch_size, len(self.examples)) // shards) * shards
    stop_ids, pad = tokenizer.stop_ids, tokenizer.pad_id
    self.greedy = make_generator(cfg, mesh, stop_ids=stop_ids, pad_id=pad, group_size=1, temperature=0.0,
                                 multi_turn=False, complete=True)
    self.pass_k = int(cfg.eval.pass_k)
    self.sampled = None
    if self.pass_k > 1:
      self.sampled = make_generator(cfg, mesh, stop_ids=stop_ids, pad_id=pad, group_size=self.pass_k,
                                    multi_turn=False, complete=True)
    self.pool = RewardPool(answer_reward, num_workers=cfg.rl.reward_workers,
                           timeout_s=cfg.rl.reward_timeout_s)
    if rm_scorer is None and domain_sources(cfg).uses("reward_model"):
      rm_scorer = reward_model_scorer(cfg, mesh, tokenizer)
    self.rm = rm_scorer
    self.rm_scores = None  # [N] the last greedy pass's reward-model scores

  def _run(self, rollout, params, extra, key, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(correct [N, group], lengths [N, group]) over every example, in batches padded to shape."""
    correct, lengths, rm_scores = [], [], []
    for start in range(0, len(self.examples), self.batch):
      chunk = self.examples[start:start + self.batch]
      padded = chunk + [chunk[-1]] * (self.batch - len(chunk))
      prompts = next_prompts(iter(padded), self.tokenizer, count=self.batch,
                             max_len=self.cfg.rl.max_prompt_len, overflow="truncate")
      out = rollout(params, extra, prompts.tokens, prompts.mask, jax.random.fold_in(key, start))
      columns = response_columns(rollout_rows({"tokens": out.tokens, "response_mask": out.response_mask}),
                                 self.cfg.rl.max_new_tokens)  # only these come to the host
      texts = self.tokenizer.decode_batch(np.where(columns["response_mask"], columns["tokens"],
                                                   self.tokenizer.pad_id))
      scores, _ = self.pool.score(texts, [e for e in padded for _ in range(group)])
      n = len(chunk) * group
      if self.rm is not None and group == 1:
        rm_scores.append(self.rm(texts[:n], chunk)[0])
      correct.append(scores[:n].reshape(len(chunk), group))
      lengths.append(hosts.to_host(out.lengths)[:n].reshape(len(chunk), group))
    if rm_scores:
      self.rm_scores = np.concatenate(rm_scores)
    return np.concatenate(correct), np.concatenate(lengths)

  def __call__(self, params, extra, key: jax.Array | None = None) -> dict[str, float]:
    """Metrics: eval/accuracy (greedy), eval/response_len, eval/pass@k (when eval.pass_k > 1),
    eval/rm_score (with a reward model: its mean score of the greedy completions), each also per
    domain as eval/<metric>/<domain>, and eval/num_prompts."""
    key = jax.random.key(self.cfg.seed + 104729) if key is None else key
    correct, lengths = self._run(self.greedy, params, extra, key, 1)
    solved = (correct[:, 0] >= 1.0).astype(np.float32)
    metrics = {"eval/accuracy": float(solved.mean()), "eval/response_len": float(lengths.mean()),
               "eval/num_prompts": len(self.examples)}
    columns = {"accuracy": solved, "response_len": lengths[:, 0].astype(np.float32)}
    if self.rm is not None:
      metrics["eval/rm_score"] = float(self.rm_scores.mean())
      columns["rm_score"] = self.rm_scores
    if self.sampled is not None:
      sampled, _ = self._run(self.sampled, params, extra, jax.random.fold_in(key, 1), self.pass_k)
      any_correct = (sampled >= 1.0).any(axis=1).astype(np.float32)
      metrics[f"eval/pass@{self.pass_k}"] = float(any_correct.mean())
      columns[f"pass@{self.pass_k}"] = any_correct
    domains = [str(e.get("domain", "")) for e in self.examples]
    if len(set(domains)) > 1 or domains[0]:
      for domain in sorted(set(domains)):
        rows = np.asarray([d == domain for d in domains])
        for name, values in columns.items():
          metrics[f"eval/{name}/{domain or 'none'}"] = float(values[rows].mean())
    return metrics

  def close(self) -> None:
    self.pool.close()
