"""Reward sources per domain: a verifier on the host (rl.rewards), a reward model or a generative judge
on the mesh, or a weighted mix, chosen by each sample's domain.

  sources = domain_sources(cfg)                         # DomainSources; ValueError naming the field
  check_reward_sources(cfg)                            # every file and tokenizer, no model loaded
  pool = reward_pool(cfg, mesh, tokenizer)             # RewardPool, or SourcedRewards when a domain uses a model
  rewards, info = pool.score(completions, examples)   # [N] float32 and info, as RewardPool.score

rl.reward_sources = "chat=reward_model;writing=judge:0.5,verifier:0.5;*=verifier": per domain (an
example's "domain"), a weighted sum of sources, "name:weight,..." as rl.rewards; "*" is every domain
not named (default: verifier); "" is the verifier everywhere (a plain RewardPool, as before). A domain of
the data.domains registry may name its sources in its own "sources" field instead ("reward_model:1.0").
  verifier      rl.rewards on the RewardPool's threads (each sample within rl.reward_timeout_s)
  reward_model  rl.reward_model_checkpoint's score (rl/rewards/rm_scorer.py), length guards applied
  judge         rl.judge_checkpoint's verdict / rl.judge_max_score (rl/rewards/judge.py)

Scoring one batch (`SourcedRewards.score`, or `submit` then `collect`): the verifier's samples are
queued on the pool's threads first, then each model source's batched calls for every sample of its
domains are dispatched to the mesh (nothing waits), then both are collected. The RL step submits a
batch before it dispatches the next rollout (asynchronous RL), so the devices score batch k ahead of
generating batch k + 1 while the host verifies (rl/step/program.next_in_flight). A sample's reward
is sum_s weight_s * score_s over its own domain's sources; the reward goes into the advantages as a
verifier's does (it is the ScoredBatch's reward). rl.reward_norm="domain" then whitens the rewards within each domain of the
batch (`normalize_per_domain`): for batch-level estimators (REINFORCE++, GAE) when domains score on
other scales; group estimators (GRPO) normalise within a group, which lies in one domain, anyway.
Errors (a verifier that raised, a judge's malformed verdict) score 0 for that source and are counted
in info["reward_errors"], with the first messages in info["first_errors"].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from meshrl.rl.rewards.compose import compose, parse_weights
from meshrl.rl.rewards.judge import Judge, read_rubrics
from meshrl.rl.rewards.pool import Dispatched, Pending, RewardPool
from meshrl.rl.rewards.rm_scorer import RewardModelScorer
from meshrl.sharding import hosts
from meshrl.sharding.rules import data_parallel_size, rules_from_config
from meshrl.train import rm_source
from meshrl.train.init_from import model_config

FIELD = "rl.reward_sources"
SOURCES = ("verifier", "reward_model", "judge")
MODEL_SOURCES = {"reward_model": "rl.reward_model_checkpoint", "judge": "rl.judge_checkpoint"}
DEFAULT = "*"
Terms = tuple[tuple[str, float], ...]  # (source, weight)


@dataclasses.dataclass(frozen=True)
class DomainSources:
  """The reward sources of each domain; `default` serves every domain not named."""
  by_domain: tuple[tuple[str, Terms], ...] = ()
  default: Terms = (("verifier", 1.0),)

  def of(self, domain: str) -> Terms:
    return dict(self.by_domain).get(domain, self.default)

  def uses(self, source: str) -> bool:
    return any(name == source for _, terms in self.by_domain for name, _ in terms) or any(
        name == source for name, _ in self.default)


def parse_terms(text: str, *, field: str, domain: str | None = None) -> Terms:
  """One domain's sources, "source:weight,..." -> ((source, weight), ...); ValueError naming `field`
  for an unknown source or a weight that is not a positive number."""
  where = f" of domain {domain!r}" if domain is not None else ""
  weighted = parse_weights(text, field=f"{field} (domain {domain!r})" if domain is not None else field)
  for name, weight in weighted:
    if name not in SOURCES:
      raise ValueError(f"{field}: source {name!r}{where} is unknown; choose from {', '.join(SOURCES)}.")
    if not weight > 0:
      raise ValueError(f"{field}: weight {weight} of {name!r}{where} must be positive.")
  return tuple(weighted)


def parse_sources(spec: str, *, field: str = FIELD) -> DomainSources:
  """DomainSources from "domain=source:weight,...;..." ("" = the verifier everywhere).

  Raises:
    ValueError naming `field` and the item: no '=', an unknown source, a weight <= 0, a domain twice.
  """
  if not spec.strip():
    return DomainSources()
  parsed = {}
  for item in (part.strip() for part in spec.split(";") if part.strip()):
    domain, eq, terms = (s.strip() for s in item.partition("="))
    if not eq or not domain:
      raise ValueError(f"{field}={spec!r}: item {item!r} must be 'domain=source:weight,...' (sources: "
                       f"{', '.join(SOURCES)}; '*' for every other domain).")
    if domain in parsed:
      raise ValueError(f"{field}={spec!r} names domain {domain!r} twice.")
    weighted = parse_terms(terms, field=field, domain=domain)
    parsed[domain] = tuple(weighted)
  default = parsed.pop(DEFAULT, DomainSources.default)
  return DomainSources(tuple(parsed.items()), default)


def normalize_per_domain(rewards: np.ndarray, domains: Sequence[str], eps: float = 1e-6) -> np.ndarray:
  """rewards [N] -> [N] float32 whitened within each domain: (r - mean_d) / (std_d + eps), std
  unbiased (a domain of one sample gets 0), so domains whose sources score on other scales (a reward
  model's logits, a verifier's 0/1) weigh alike in a batch-level estimator."""
  rewards = np.asarray(rewards, np.float32)
  out = np.zeros_like(rewards)
  names = np.asarray(list(domains), dtype=object)
  for domain in set(domains):
    rows = names == domain
    values = rewards[rows]
    std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    out[rows] = (values - values.mean()) / (std + eps)
  return out


def domain_sources(cfg) -> DomainSources:
  """The run's sources: rl.reward_sources, and the "sources" of the data.domains registry's domains
  (rl/envs/registry.py); ValueError naming both when a domain is given sources in both places."""
  sources = parse_sources(cfg.rl.reward_sources)
  if not cfg.data.domains:
    return sources
  from meshrl.rl.envs.registry import load_domains  # pylint: disable=import-outside-toplevel
  named = dict(sources.by_domain)
  for spec in load_domains(cfg.data.domains):
    if not spec.sources:
      continue
    if spec.name in named:
      raise ValueError(f"{FIELD}={cfg.rl.reward_sources!r} and data.domains={cfg.data.domains!r} both give "
                       f"domain {spec.name!r} its sources; keep one.")
    named[spec.name] = parse_terms(spec.sources, field=f"data.domains {spec.name!r} sources")
  return DomainSources(tuple(named.items()), sources.default)


class BatchScorer(Protocol):
  """A model source (RewardModelScorer, Judge): `dispatch` starts a batch's scoring on the devices and
  returns at once; `finish` waits -> (scores [n] float32, info with "errors" and "first_errors")."""

  def dispatch(self, completions: Sequence[str], examples: Sequence[dict]) -> Dispatched: ...

  def finish(self, dispatched: Dispatched) -> tuple[np.ndarray, dict]: ...


class SourcedPending(NamedTuple):
  """`SourcedRewards.submit`'s batch: the verifier's queued samples and the model sources' dispatched
  scoring, with where each sample's sources are."""
  count: int  # N samples
  domains: list  # [N] each sample's domain
  terms: list  # [N] each sample's (source, weight) terms
  rows: dict  # {source: indices of the samples it scores}
  verifier: Pending | np.ndarray  # RewardPool.submit's, or the scores given to `submit`
  models: dict  # {source: Dispatched}


class SourcedRewards:
  """RewardPool's interface (`score`, `submit`/`collect`, `close`) over per-domain sources.

  Args:
    pool: the verifier's RewardPool (rl.rewards).
    sources: each domain's sources.
    scorers: {"reward_model": RewardModelScorer, "judge": Judge} for the model sources `sources` uses
      (BatchScorer each).
  """

  def __init__(self, pool: RewardPool, sources: DomainSources, scorers: Mapping[str, BatchScorer], *,
               normalize_domains: bool = False):
    missing = [name for name in MODEL_SOURCES if sources.uses(name) and name not in scorers]
    if missing:
      raise ValueError(f"{FIELD} uses {missing} but no scorer was built for it.")
    self.pool, self.sources, self.scorers = pool, sources, dict(scorers)
    self.normalize_domains = normalize_domains

  def score(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[np.ndarray, dict]:
    """-> (rewards [N] float32, info) with RewardPool's keys (reward_errors, reward_timeouts,
    first_errors, per_fn {source: [N] unweighted, 0 where unused}, by_domain) and each model
    source's own counts (rm_truncated, judge_malformed, judge_truncated); sources {source: [n] indices
    of the samples it scored}."""
    return self.collect(self.submit(completions, examples))

  def submit(self, completions: Sequence[str], examples: Sequence[dict], *,
             verified: np.ndarray | None = None) -> "SourcedPending":
    """Starts every source without waiting: the verifier's samples queued on the pool's threads, then
    each model source's scoring dispatched to the devices (`dispatch`); `collect` waits for both.
    verified: [N] the verifier's scores already known (a multi-turn episode's environment reward,
    rl/step/episode_collect.py), used as the `verifier` source instead of the pool's."""
    if len(completions) != len(examples):
      raise ValueError(f"len(completions)={len(completions)} != len(examples)={len(examples)}.")
    domains = [str(e.get("domain", "")) if isinstance(e, Mapping) else "" for e in examples]
    terms = [self.sources.of(d) for d in domains]
    rows = {name: [i for i, t in enumerate(terms) if any(n == name for n, _ in t)] for name in SOURCES}
    if verified is not None:
      verifier = np.asarray(verified, np.float32)[rows["verifier"]]
    else:
      verifier = self.pool.submit([completions[i] for i in rows["verifier"]], [examples[i] for i in rows["verifier"]])
    # With several host processes a model source's calls span the mesh: every host takes its part,
    # also with no sample of that source (or none at all) of its own.
    models = {name: scorer.dispatch([completions[i] for i in rows[name]], [examples[i] for i in rows[name]])
              for name, scorer in self.scorers.items() if rows[name] or hosts.is_multihost()}
    return SourcedPending(len(completions), domains, terms, rows, verifier, models)

  def collect(self, pending: "SourcedPending", *, normalize: bool | None = None) -> tuple[np.ndarray, dict]:
    """Waits for `submit`'s sources -> (rewards [N] float32, info), as `score` returns them.
    normalize: whiten per domain (None: as built, rl.reward_norm); False for a caller that whitens
    the rewards of every host together after gathering them."""
    count, domains, terms, rows = pending.count, pending.domains, pending.terms, pending.rows
    per_fn = {name: np.zeros(count, np.float32) for name in SOURCES if rows[name]}
    info = {"reward_errors": 0, "reward_timeouts": 0, "first_errors": []}
    for name, dispatched in pending.models.items():
      scores, own = self.scorers[name].finish(dispatched)
      if not rows[name]:  # this host's part in another host's calls (several processes)
        continue
      per_fn[name][rows[name]] = scores
      info["reward_errors"] += own["errors"]
      info["first_errors"] += [f"{name}: {message}" for message in own["first_errors"]]
      info.update({k: v for k, v in own.items() if k not in ("errors", "first_errors", "verdicts")})
    if isinstance(pending.verifier, np.ndarray):  # given to `submit` (an environment's rewards)
      verified, pool_info = pending.verifier, {
          "reward_errors": 0, "reward_timeouts": 0, "given_up": np.zeros(len(pending.verifier), bool),
          "reward_env_retries": 0, "reward_env_given_up": 0, "first_errors": []}
    else:
      verified, pool_info = self.pool.collect(pending.verifier)
    if rows["verifier"]:
      per_fn["verifier"][rows["verifier"]] = verified
    info["reward_errors"] += pool_info["reward_errors"]
    info["reward_timeouts"] += pool_info["reward_timeouts"]
    info["given_up"] = np.zeros(count, bool)
    info["given_up"][rows["verifier"]] = pool_info["given_up"]
    info["reward_env_retries"] = pool_info["reward_env_retries"]
    info["reward_env_given_up"] = pool_info["reward_env_given_up"]
    info["first_errors"] = (pool_info["first_errors"] + info["first_errors"])[:3]
    total = np.asarray([sum(w * per_fn[n][i] for n, w in t) for i, t in enumerate(terms)], np.float32)
    if self.normalize_domains if normalize is None else normalize:
      total = normalize_per_domain(total, domains)
    info["per_fn"] = per_fn
    info["sources"] = {name: np.asarray(rows[name], np.int64) for name in per_fn}  # the samples each scored
    info["by_domain"] = {d: float(np.mean(total[[x == d for x in domains]])) for d in sorted(set(domains))}
    return total.reshape(count), info

  def close(self) -> None:
    self.pool.close()


# --------------------------------------------------------------------------------------------------
# From the config: the check (files, tokenizers, rubrics; nothing loaded) and the builder.


def check_reward_sources(cfg) -> DomainSources:
  """Everything the sources of `cfg` need, read from files only: rl.reward_sources parsed, each model
  source's checkpoint (it exists, reads the policy's tokenizer; a reward model has a score head), the
  judge's rubrics and lengths; a checkpoint set for a source no domain uses is refused (it would be
  ignored). ValueError naming the field, before anything is loaded or written."""
  rl = cfg.rl
  sources = domain_sources(cfg)
  for name, field in MODEL_SOURCES.items():
    path = rl[field.split(".")[1]]
    if sources.uses(name) and not path:
      raise ValueError(f"a domain of {FIELD}={rl.reward_sources!r} (or of data.domains) uses {name!r}: set {field} (a "
                       f"{'reward model, e.g. from scripts/train_rm.py' if name == 'reward_model' else 'judge model'}).")
    if path and not sources.uses(name):
      raise ValueError(f"{field}={path!r} is set but no domain of {FIELD}={rl.reward_sources!r} (or of "
                       f"data.domains) uses {name!r}: name it there (e.g. '*={name}') or unset {field}.")
  if sources.uses("reward_model"):
    rm_source.check_reward_model(rl.reward_model_checkpoint, cfg)
  if sources.uses("judge"):
    judge_cfg = rm_source.check_judge_model(rl.judge_checkpoint, cfg)
    read_rubrics(rl.judge_rubrics)
    if not rl.judge_max_score > 0:
      raise ValueError(f"rl.judge_max_score={rl.judge_max_score} must be positive.")
    for field in ("judge_prompt_len", "judge_max_tokens"):
      if rl[field] < 1:
        raise ValueError(f"rl.{field}={rl[field]} must be at least 1.")
    if rl.judge_prompt_len + rl.judge_max_tokens > judge_cfg.model.max_seq_len:
      raise ValueError(f"rl.judge_prompt_len={rl.judge_prompt_len} + rl.judge_max_tokens={rl.judge_max_tokens} "
                       f"exceeds the judge's model.max_seq_len={judge_cfg.model.max_seq_len}.")
  return sources


def _rows(cfg, mesh) -> int:
  """Rows per scoring call: a step's samples, rounded up to a multiple of the mesh's batch shards and
  of the host processes (each fills its own equal part of every call)."""
  shards = data_parallel_size(mesh.shape) if mesh is not None else 1
  multiple = math.lcm(shards, jax.process_count())
  batch = cfg.rl.prompts_per_step * cfg.rl.group_size
  return -(-batch // multiple) * multiple


def reward_model_scorer(cfg, mesh, tokenizer, *, checked: bool = False) -> RewardModelScorer:
  """rl.reward_model_checkpoint loaded beside the policy on `mesh` (frozen, sharded by the policy's
  rules), scoring a step's samples per call with rl.rm_length_* applied. checked: the caller ran
  `check_reward_sources` already."""
  if not checked:
    check_reward_sources(cfg)
  rl, rules = cfg.rl, rules_from_config(cfg.mesh)
  model, rm_cfg = rm_source.load_reward_model(rl.reward_model_checkpoint, cfg, mesh, rules=rules)
  row_len = min(rm_cfg.model.max_seq_len, rl.max_prompt_len + rl.max_new_tokens + 2)  # + BOS, EOS
  threshold = None
  if rl.rm_binarize:
    from meshrl.train.rm_calibration import read_threshold  # pylint: disable=import-outside-toplevel
    threshold = read_threshold(rl.reward_model_checkpoint)
  return RewardModelScorer(model, tokenizer, rows=_rows(cfg, mesh), row_len=row_len, mesh=mesh, rules=rules,
                           length_penalty=rl.rm_length_penalty, length_normalize=rl.rm_length_normalize,
                           threshold=threshold)


def reward_pool(cfg, mesh, tokenizer, *, on_given_up=None):
  """The run's reward scorer: a RewardPool of rl.rewards when every domain uses the verifier alone
  (and rl.reward_norm="none"), else SourcedRewards with the model sources loaded beside the policy on `mesh` (frozen, sharded by
  the policy's rules). Checked first (`check_reward_sources`). Infrastructure failures of the
  verifiers are retried by rl.env_retries / rl.env_backoff_s; `on_given_up(example, reason)` records
  the samples given up on (the run's quarantine)."""
  sources = check_reward_sources(cfg)
  models = any(sources.uses(name) for name in MODEL_SOURCES)
  pool = RewardPool(compose(cfg.rl.rewards), num_workers=cfg.rl.reward_workers, timeout_s=cfg.rl.reward_timeout_s,
                    max_retries=cfg.rl.env_retries, backoff_s=cfg.rl.env_backoff_s, on_given_up=on_given_up)
  normalize = cfg.rl.reward_norm == "domain"
  if not models:
    return SourcedRewards(pool, sources, {}, normalize_domains=True) if normalize else pool
  rl, rules, rows = cfg.rl, rules_from_config(cfg.mesh), _rows(cfg, mesh)
  scorers = {}
  if sources.uses("reward_model"):
    scorers["reward_model"] = reward_model_scorer(cfg, mesh, tokenizer, checked=True)
  if sources.uses("judge"):
    model, judge_cfg = rm_source.load_judge_model(rl.judge_checkpoint, cfg, mesh, rules=rules)
    mc = model_config(judge_cfg, mesh, rules=rules_from_config(cfg.mesh, "rollout"))  # the judge's, generating
    mc = dataclasses.replace(mc, kv_cache_dtype=rl.kv_cache_dtype)
    scorers["judge"] = Judge(model, mc, tokenizer, read_rubrics(rl.judge_rubrics), max_score=rl.judge_max_score,
                             prompt_len=rl.judge_prompt_len, max_tokens=rl.judge_max_tokens, rows=rows, mesh=mesh,
                             rules=rules)
  return SourcedRewards(pool, sources, scorers, normalize_domains=normalize)
