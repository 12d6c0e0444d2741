"""The run's prompts on either side of the held-out split: data.tasks' generated families, the rows of
data.jsonl / data.array_record (each file a family of weight 1 in the mixture) and the multi-turn
families data.tasks names (rl/step/episodes.episode_pools).

Training draws the "train" side (rl/step/driver.train_source; every prompt when data.eval_fraction
is 0 or eval.jsonl holds the held-out prompts); evaluation without eval.jsonl draws the "eval" side of
the same mixture (rl/step/evaluation.held_out_examples), so a file's held-out rows are the ones
evaluated, as its other rows are the ones trained on.
"""

from __future__ import annotations

from meshrl.rl.envs import TaskMixture
from meshrl.rl.envs.prompts import ArrayRecordSource, JsonlSource
from meshrl.rl.step.episodes import episode_pools


def file_sources(cfg) -> dict:
  """The pools of file rows (grain random-access sources, rl/envs/prompts.py): data.jsonl as "jsonl",
  data.array_record as "array_record"; malformed rows are skipped and listed in each `.bad`."""
  pools = {}
  if cfg.data.jsonl:
    pools["jsonl"] = JsonlSource(cfg.data.jsonl, skip_bad=cfg.data.skip_bad_rows)
  if cfg.data.array_record:
    pools["array_record"] = ArrayRecordSource(cfg.data.array_record.split(","),
                                              skip_bad=cfg.data.skip_bad_rows)
  return pools


def task_mixture(cfg, *, split: str, seed: int, pools: dict | None = None) -> TaskMixture:
  """data.tasks with the file pools (weight 1 each) and the multi-turn families' pools, drawing only
  from `split` ("all", "train" or "eval") of the hash split data.eval_fraction.

  `pools`: another mixture of the same config's pools (the training source's), so that evaluation
  draws its side of the split without reading data.jsonl / data.array_record a second time; else
  they are read here."""
  if pools is None:
    pools = {**file_sources(cfg), **episode_pools(cfg)}
  spec = cfg.data.tasks
  for name in ("jsonl", "array_record"):  # file_sources' pools, weight 1 each
    if name in pools:
      spec = f"{name}:1.0" if not spec else f"{spec},{name}:1.0"
  pools = pools or None
  return TaskMixture(spec, difficulty=cfg.data.difficulty, seed=seed, pools=pools, split=split,
                     eval_fraction=cfg.data.eval_fraction)
