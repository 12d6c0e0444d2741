"""Host-side glue between rollout and update: prompts in, scored and filtered update batches out.

Numpy over one step's host arrays, so it runs beside the accelerator's work; per-token fields kept on
the devices (rl/batches/rows.DeviceRows) are moved by row, and reduced there when a metric needs them.

Axis legend: P prompts, G group size, B = P * G sequences, S tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax
import numpy as np

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.batches import rows as rows_lib
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.rewards import overlong_penalty
from meshrl.rl.batches.rows import PAD_FILL
from meshrl.rl.batches.rows import DeviceRows
from meshrl.rl.rewards.pool import RewardPool
from meshrl.sharding import hosts


@dataclasses.dataclass
class PromptBatch:
  examples: list[dict]  # P task examples ({"prompt", "answer", "domain", ...})
  tokens: np.ndarray  # [P, Lp] int32, left-padded
  mask: np.ndarray  # [P, Lp] bool
  rejected: int  # prompts over budget that were skipped (prompt_overflow = "reject")
  truncated: int  # prompts over budget that were cut to their last Lp tokens


def next_prompts(examples: Iterator[dict], tokenizer: Tokenizer, *, count: int, max_len: int,
                 overflow: str) -> PromptBatch:
  """Draws `count` prompts, encodes them left-padded to `max_len`; over-long ones are truncated or
  skipped (and counted) per `overflow` ("truncate" or "reject")."""
  if overflow not in ("truncate", "reject"):
    raise ValueError(f"rl.prompt_overflow={overflow!r}; choose truncate or reject.")
  chosen, rejected, truncated = [], 0, 0
  while len(chosen) < count:
    example = next(examples)
    length = len(tokenizer.encode(tokenizer.render_prompt(example["prompt"])))
    if length > max_len:
      if overflow == "reject":
        rejected += 1
        if rejected > 100 * count:
          raise ValueError(f"every prompt is longer than rl.max_prompt_len={max_len} tokens "
                           f"(the last had {length}); raise the budget or use truncate.")
        continue
      truncated += 1
    chosen.append(example)
  tokens, mask = tokenizer.encode_batch([tokenizer.render_prompt(e["prompt"]) for e in chosen], length=max_len,
                                        padding="left", overflow="truncate")
  return PromptBatch(chosen, tokens, mask, rejected, truncated)


def shared_prompts(cfg, processes: int | None = None) -> bool:
  """Whether every host draws the same prompts (the whole stream) and scores its `hosts.share` of the
  samples, instead of an equal block of its own: for partial rollouts (whose groups end unevenly over
  the hosts) and when the step's prompts do not split evenly over the host processes (a pod of more
  hosts than prompts: paper_3t's 8 prompts of 1M tokens on 1,024 v5p hosts)."""
  processes = jax.process_count() if processes is None else processes
  return cfg.rl.rollout_token_budget > 0 or cfg.rl.prompts_per_step % processes != 0


def score_rollout(arrays: dict, examples: list[dict], tokenizer: Tokenizer, pool: RewardPool, *,
                  group_size: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty_value: float) -> ScoredBatch:
  """Decodes the responses of one rollout ([B, ...] numpy arrays, B = P * G) and scores them on
  `pool`; a reward function that raises or hangs scores 0 and is counted in `info`; a sample whose
  reward's infrastructure kept failing (RewardPool's given_up) is not valid (no gradient).

  DAPO overlong shaping adds a penalty (<= 0) to the reward of responses within `overlong_buffer`
  tokens of the budget; `correct` keeps the unshaped task reward.
  """
  return start_scoring(arrays, examples, tokenizer, pool, group_size=group_size, max_new_tokens=max_new_tokens,
                       overlong_buffer=overlong_buffer, overlong_penalty_value=overlong_penalty_value)()


def start_scoring(arrays: dict, examples: list[dict], tokenizer: Tokenizer, pool: RewardPool, *,
                  group_size: int, max_new_tokens: int, overlong_buffer: int,
                  overlong_penalty_value: float, normalize: bool | None = None) -> Callable[[], ScoredBatch]:
  """`score_rollout` in two halves: decodes the responses and submits them to `pool` (verifiers
  queued on its threads, model sources dispatched to the devices: nothing waits) -> `finish()`, which
  waits for the scores and returns the ScoredBatch. normalize: passed to a SourcedRewards pool's
  `collect` (False: the caller whitens per domain after gathering every host's rewards)."""
  columns = response_columns(arrays, max_new_tokens)
  texts = tokenizer.decode_batch(np.where(columns["response_mask"], columns["tokens"], tokenizer.pad_id))
  per_sample = [ex for ex in examples for _ in range(group_size)]
  pending = pool.submit(texts, per_sample)

  def finish() -> ScoredBatch:
    rewards, info = pool.collect(pending) if normalize is None else pool.collect(pending, normalize=normalize)
    correct = rewards.astype(np.float32)
    shaped = correct + overlong_penalty(arrays["lengths"], max_len=max_new_tokens, buffer=overlong_buffer,
                                        penalty=overlong_penalty_value)
    return ScoredBatch(arrays=arrays, rewards=shaped.astype(np.float32), correct=correct,
                       sample_valid=~np.asarray(info.get("given_up", np.zeros(len(texts), bool)), bool),
                       domains=[str(ex.get("domain", "")) for ex in per_sample], texts=texts, info=info)
  return finish


def response_columns(arrays: dict, max_new_tokens: int) -> dict[str, np.ndarray]:
  """The response columns [B, N] (the last N = max_new_tokens) of tokens and response_mask as host
  numpy (what scoring reads). A field kept on the devices (rl/batches/rows.DeviceRows) is sliced there and
  all-gathered, so with several processes every host calls this with the same rows."""
  columns = slice(-max_new_tokens, None)
  return {name: arrays[name].to_host(columns) if isinstance(arrays[name], DeviceRows)
          else np.asarray(arrays[name])[:, columns] for name in ("tokens", "response_mask")}


def informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """[P] bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these)."""
  grouped = rewards.reshape(-1, group_size)
  return grouped.max(axis=1) > grouped.min(axis=1)


def enough_groups(rounds: list[ScoredBatch], cfg) -> bool:
  """Whether the rollout rounds so far fill a step (cfg: the `rl` section): always without dynamic
  sampling; with it, once rl.prompts_per_step informative groups have arrived."""
  useful = sum(int(informative_groups(r.rewards, cfg.group_size).sum()) for r in rounds)
  return not cfg.dynamic_sampling or useful >= cfg.prompts_per_step


def step_groups(rounds: list[ScoredBatch], cfg) -> ScoredBatch:
  """The step's batch of rl.prompts_per_step groups from its rollout rounds (`select_groups`)."""
  return select_groups(rounds, num_groups=cfg.prompts_per_step, group_size=cfg.group_size,
                       dynamic=cfg.dynamic_sampling)


def empty_scored(arrays: dict) -> ScoredBatch:
  """A ScoredBatch of no samples (arrays with 0 rows): a partial-rollout step in which no group ended."""
  return ScoredBatch(arrays=arrays, rewards=np.zeros(0, np.float32), correct=np.zeros(0, np.float32),
                     sample_valid=np.zeros(0, bool), domains=[], texts=[],
                     info={"reward_errors": 0, "reward_timeouts": 0, "first_errors": []})


def select_groups(rollouts: list[ScoredBatch], *, num_groups: int, group_size: int,
                  dynamic: bool) -> ScoredBatch:
  """Assembles a batch of exactly `num_groups` groups from one or more scored rollouts.

  With `dynamic`, informative groups come first (in order of arrival); if too few exist the batch is
  topped up with uninformative ones, whose samples get `sample_valid = False` (no gradient). If the
  rollouts hold fewer than `num_groups` groups in all (partial rollouts: only the groups that ended),
  the rest are blank padding groups (no real token, reward 0, `sample_valid = False`).
  """
  pieces = []  # (rollout index, group index, informative)
  for r, rollout in enumerate(rollouts):
    useful = informative_groups(rollout.rewards, group_size)
    pieces += [(r, g, bool(u)) for g, u in enumerate(useful)]
  if dynamic:
    pieces = [p for p in pieces if p[2]] + [p for p in pieces if not p[2]]
  pieces = pieces[:num_groups]
  blank = (num_groups - len(pieces)) * group_size
  # The batch's samples as rows of the rounds joined in order, followed by one blank sample, which
  # every padding sample repeats: one index for every field, one take per field.
  starts = np.cumsum([0] + [len(rollout.rewards) for rollout in rollouts])
  index = np.concatenate([starts[r] + g * group_size + np.arange(group_size) for r, g, _ in pieces]
                         + [np.full(blank, starts[-1])]).astype(np.int64)

  def gather(get, fill=0):
    values = [get(rollout) for rollout in rollouts]
    if all(isinstance(v, DeviceRows) for v in values):  # the samples stay on the devices: rows only
      return rows_lib.concatenate(values, blank=1)[index]
    values = [v.to_host() if isinstance(v, DeviceRows) else np.asarray(v) for v in values]  # a round
    # restored from a checkpoint (host arrays) may sit among rounds on the devices
    return np.concatenate(values + [np.full((1,) + values[0].shape[1:], fill, values[0].dtype)])[index]

  def gather_list(get):
    joined = [item for rollout in rollouts for item in get(rollout)] + [""]
    return [joined[i] for i in index]
  arrays = {k: gather(lambda ro, k=k: ro.arrays[k], PAD_FILL.get(k, 0)) for k in rollouts[0].arrays}
  valid = gather(lambda ro: np.repeat(informative_groups(ro.rewards, group_size) | (not dynamic), group_size),
                 False)
  return ScoredBatch(arrays=arrays, rewards=gather(lambda ro: ro.rewards),
                     correct=gather(lambda ro: ro.correct), sample_valid=valid,
                     domains=gather_list(lambda ro: ro.domains), texts=gather_list(lambda ro: ro.texts),
                     info={})


def per_domain(values: np.ndarray, domains: list[str], prefix: str) -> dict[str, float]:
  """{"<prefix>/<domain>": mean of `values` [B] over that domain's samples}; {} without domains."""
  names = sorted(set(domains))
  if not names or names == [""]:
    return {}
  return {f"{prefix}/{d or 'none'}": float(np.mean(values[[x == d for x in domains]])) for d in names}


def batch_metrics(first: ScoredBatch, batch: ScoredBatch, lengths: np.ndarray, group_size: int) -> dict:
  """The reward and length metrics of a step's collect: of its `first` rollout round (an unbiased
  sample of the policy; `lengths` [B] its response lengths) and of the assembled `batch` (after
  dynamic sampling), overall and per domain."""
  lengths = np.asarray(lengths, np.float32)
  valid = batch.sample_valid
  return {
      "reward_mean": float(first.correct.mean()), "reward_std": float(first.correct.std()),
      "shaped_reward_mean": float(first.rewards.mean()),
      "batch_reward_mean": float(batch.correct[valid].mean()) if valid.any() else 0.0,
      "response_len_mean": float(lengths.mean()),
      "truncated_frac": float(first.arrays["truncated"].mean()),
      "groups_kept": int(valid.reshape(-1, group_size)[:, 0].sum()),
      **success_metrics(first.correct, valid, group_size),
      "empty_responses": int((lengths <= 1).sum()),
      "sample_text": first.texts[0][:40],
      **per_domain(first.correct, first.domains, "reward_mean"),
      **per_domain(lengths, first.domains, "response_len"),
      **source_metrics(first.info, first.domains),
  }


def success_metrics(correct: np.ndarray, valid: np.ndarray, group_size: int) -> dict[str, float]:
  """How much a step had to learn from (issue 33): `solved_frac`, the share of the first round's
  prompts ([B] `correct`, B = P * G) with at least one success (absent when no group ended), and
  `all_groups_dropped`, 1.0 when the assembled batch ([B'] `valid`) kept no group, so no gradient
  was taken: such a step is not an update that measured entropy 0 or a loss of 0 (its update
  figures are left out of the record, rl/step/driver.without_unmeasured)."""
  out = {"all_groups_dropped": float(not np.asarray(valid).any())}
  if len(correct):
    out["solved_frac"] = float((np.asarray(correct).reshape(-1, group_size).max(axis=1) > 0).mean())
  return out


SOURCE_COUNTS = ("rm_truncated", "judge_malformed", "judge_truncated")


def source_metrics(info: dict, domains: list[str]) -> dict[str, float]:
  """The model sources' own figures of a scored round (rl/rewards/sources.py; {} without them): each
  source's mean unweighted score over the samples it scored, overall and per domain
  (`score/<source>`, `score/<source>/<domain>`: a reward model's score beside the verifier's on
  the same domain shows reward hacking), and their counts (judge_malformed, ...)."""
  per_fn, sources = info.get("per_fn", {}), info.get("sources")
  if sources is None:
    return {}
  metrics = {k: int(info[k]) for k in SOURCE_COUNTS if k in info}
  for name, rows in sources.items():
    if not len(rows):
      continue
    scores = np.asarray(per_fn[name])[rows]
    metrics[f"score/{name}"] = float(scores.mean())
    metrics.update(per_domain(scores, [domains[i] for i in rows], f"score/{name}"))
  return metrics


SCORING_COUNTS = ("reward_errors", "reward_timeouts", "reward_env_retries", "reward_env_given_up") + SOURCE_COUNTS


def gather_scoring_info(own: dict, offset: int, count: int) -> dict:
  """Every host's scoring info over its own `count` samples (this host's start at sample `offset` of
  the batch; hosts in process order) -> the batch's: the counts summed, the first errors joined, and
  the model sources' per-sample scores and rows (`source_metrics`) concatenated. Collective (one
  `gather_objects`); with one process the same keys, as they are."""
  mine = {k: int(own[k]) for k in SCORING_COUNTS if k in own}
  mine["first_errors"], mine["count"] = list(own.get("first_errors", [])), int(count)
  if own.get("sources") is not None:
    mine["per_fn"] = {name: np.asarray(v, np.float32).tolist() for name, v in own["per_fn"].items()}
    mine["sources"] = {name: (np.asarray(v, np.int64) + offset).tolist() for name, v in own["sources"].items()}
  infos = hosts.gather_objects([mine])
  out = {k: sum(i.get(k, 0) for i in infos) for k in SCORING_COUNTS if any(k in i for i in infos)}
  out["first_errors"] = [e for i in infos for e in i["first_errors"]]
  names = sorted({n for i in infos for n in i.get("sources", {})})
  if any("sources" in i for i in infos):
    out["per_fn"] = {n: np.concatenate([np.asarray(i.get("per_fn", {}).get(n, [0.0] * i["count"]), np.float32)
                                        for i in infos]) for n in names}
    out["sources"] = {n: np.concatenate([np.asarray(i.get("sources", {}).get(n, []), np.int64) for i in infos])
                      for n in names}
  return out


def staleness(arrays: dict, version: int, sharding=None) -> dict:
  """Policy versions behind the current one, mean and max over the batch's generated tokens (the
  response mask's; prompts and observations have none). Fields kept on the devices are reduced there
  (gathered in `sharding`): the two values are then jax scalars that rl/step/program.rl_step fetches
  with the update's metrics, and no [B, S] field comes to the host."""
  versions, mask = arrays["policy_version"], arrays["response_mask"]
  if isinstance(versions, DeviceRows) and isinstance(mask, DeviceRows):
    fields = rows_lib.gather_many({"versions": versions, "mask": mask}, sharding)
    return _staleness_program(fields["versions"], fields["mask"], version)
  return {k: float(v) for k, v in _behind(np.asarray(versions), np.asarray(mask, bool), version, np).items()}


def _behind(versions, mask, version, xp) -> dict:
  """staleness's arithmetic in numpy or jax.numpy (`xp`); 0 for a batch without generated tokens."""
  count = mask.sum()
  behind = (version - versions).astype(xp.float32)
  return {"staleness_mean": xp.where(count > 0, xp.where(mask, behind, 0).sum() / xp.maximum(count, 1), 0.0),
          "staleness_max": xp.where(count > 0, xp.where(mask, behind, -xp.inf).max(), 0.0)}


_staleness_program = jax.jit(lambda versions, mask, version: _behind(versions, mask, version, jax.numpy))
