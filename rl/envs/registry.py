"""The domain registry: domains declared in a JSONL file, and the mixture that serves them.

One JSON object per line (JSONL: no new dependency, and an error can name the line):
  {"name": "arith_easy", "source": "generator:arithmetic", "reward": "numeric", "weight": 2.0,
   "priority": 1, "quota": 0.1, "timeout_s": 10, "max_turns": 1, "difficulty": 1}
Required: name, source, reward, weight. Optional: priority (0), quota (0: none; least share of every
batch), timeout_s (30), max_turns (1), difficulty (1; generators only), runtime ("build" or "host":
how Terminal-Bench task directories get their runtime, rl/envs/tbench.py), sources ("": the reward's
verifier; else the domain's reward sources, "reward_model:1.0,verifier:0.5", rl/rewards/sources.py).
Unknown fields are errors.
  source  "generator:<family>" (rl/envs/mixture.py DOMAINS), "jsonl:<path>" or "tasks:<dir>" (terminal
          task directories, rl/envs/terminal.py, and Terminal-Bench task directories, run as
          multi-turn terminal tasks); paths relative to the domain file
  reward  a verifier name (rl.rewards VERIFIERS) stamped on every example as its "verifier"; task
          directories take "terminal" (check.sh after the episode)

`DomainMixture` is random access like TaskMixture (example i depends on (domains, seed, i)), with the
same hash split of prompts into train and eval sides, per-domain held-out examples
(`held_out(per_domain)`), batches composed by the scheduler's quotas (rl/envs/scheduler.py
`plan_batch`) when given `batch_size`, a quarantine (rl/envs/quality.py): quarantined task ids
are never drawn, including ids added while training runs, and the gate's curriculum flags: tasks a
policy always or never solves are drawn less (`flagged_weight`, a floor above zero). Every
example's "domain" is the domain's name, so the RL step's reward_mean/<domain> and the evaluator's
eval/accuracy/<domain> are per registry domain.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Container, Iterator, Mapping, Sequence

import numpy as np

from meshrl.rl.envs.jsonl import load_jsonl
from meshrl.rl.envs.mixture import DOMAINS, distinct_examples, in_eval_split, make_example
from meshrl.rl.envs.scheduler import DomainPolicy, check_quotas, plan_batch
from meshrl.rl.envs.terminal import load_tasks

TERMINAL_REWARD = "terminal"
CURRICULUM_FLAGS = ("always_solved", "never_solved")  # the quality gate's flags (rl/envs/quality.py)
FLAGGED_WEIGHT = 0.25  # a flagged task's share of its domain's draws, relative to an unflagged one
REQUIRED = {"name": str, "source": str, "reward": str, "weight": (int, float)}
OPTIONAL = {"priority": (int, 0), "quota": ((int, float), 0.0), "timeout_s": ((int, float), 30.0),
            "max_turns": (int, 1), "difficulty": (int, 1), "runtime": (str, "build"), "sources": (str, "")}
RUNTIMES = ("build", "host")  # how Terminal-Bench task directories get their runtime (rl/envs/tbench.py)


@dataclasses.dataclass(frozen=True)
class DomainSpec:
  name: str
  kind: str  # "generator", "jsonl" or "tasks"
  target: str  # family name, or absolute path
  reward: str
  weight: float
  priority: int = 0
  quota: float = 0.0
  timeout_s: float = 30.0
  max_turns: int = 1
  difficulty: int = 1
  runtime: str = "build"
  sources: str = ""  # reward sources, "reward_model:1.0,verifier:0.5" (rl/rewards/sources.py); "": the reward's verifier

  @property
  def policy(self) -> DomainPolicy:
    return DomainPolicy(weight=self.weight, priority=self.priority, quota=self.quota)


def _fail(where: str, name, message: str):
  raise ValueError(f"{where}: domain {name!r}: {message}")


def parse_domain(row, where: str, base_dir: str, rewards: Container[str]) -> DomainSpec:
  """One domain from a parsed row; ValueError naming `where` (file:line), the domain and the field."""
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a domain is a JSON object, got {type(row).__name__}.")
  name = row.get("name", "?")
  for field, kind in REQUIRED.items():
    if field not in row:
      _fail(where, name, f"field {field!r} is missing (required: {sorted(REQUIRED)}).")
    if isinstance(row[field], bool) or not isinstance(row[field], kind):
      _fail(where, name, f"field {field!r}={row[field]!r} has the wrong type.")
  unknown = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
  if unknown:
    _fail(where, name, f"unknown field(s) {unknown}; allowed: {sorted(REQUIRED) + sorted(OPTIONAL)}.")
  values = {}
  for field, (kind, default) in OPTIONAL.items():
    value = row.get(field, default)
    if isinstance(value, bool) or not isinstance(value, kind):
      _fail(where, name, f"field {field!r}={value!r} has the wrong type.")
    values[field] = value
  kind, _, target = row["source"].partition(":")
  if kind not in ("generator", "jsonl", "tasks") or not target:
    _fail(where, name, f"field 'source'={row['source']!r}: use generator:<family>, jsonl:<path> or "
                       f"tasks:<dir>.")
  if kind == "generator":
    if target not in DOMAINS:
      _fail(where, name, f"field 'source': generator {target!r} is unknown; choose from "
                         f"{sorted(DOMAINS)}.")
    if not 1 <= values["difficulty"] <= DOMAINS[target].levels:
      _fail(where, name, f"field 'difficulty'={values['difficulty']} must lie in "
                         f"1..{DOMAINS[target].levels}.")
  else:
    target = os.path.normpath(os.path.join(base_dir, target))
    exists = os.path.isfile(target) if kind == "jsonl" else os.path.isdir(target)
    if not exists:
      _fail(where, name, f"field 'source': {target} does not exist.")
  reward = row["reward"]
  if (kind == "tasks") != (reward == TERMINAL_REWARD):
    _fail(where, name, f"field 'reward'={reward!r}: task directories take {TERMINAL_REWARD!r}, "
                       f"and only they.")
  if reward != TERMINAL_REWARD and reward not in rewards:
    _fail(where, name, f"field 'reward'={reward!r} is unknown; choose from {sorted(rewards)}.")
  if not (math.isfinite(row["weight"]) and row["weight"] > 0):
    _fail(where, name, f"field 'weight'={row['weight']} must be positive.")
  if not 0 <= values["quota"] <= 1:
    _fail(where, name, f"field 'quota'={values['quota']} must lie in [0, 1].")
  if values["runtime"] not in RUNTIMES:
    _fail(where, name, f"field 'runtime'={values['runtime']!r}: choose one of {list(RUNTIMES)}.")
  if not values["timeout_s"] > 0 or values["max_turns"] < 1:
    _fail(where, name, f"timeout_s={values['timeout_s']} must be > 0 and "
                       f"max_turns={values['max_turns']} >= 1.")
  if not isinstance(name, str) or not name.strip() or "/" in name:
    _fail(where, name, "field 'name' must be a non-empty string without '/'.")
  if values["sources"]:
    from meshrl.rl.rewards.sources import parse_terms  # pylint: disable=import-outside-toplevel
    try:
      parse_terms(values["sources"], field="field 'sources'")
    except ValueError as error:
      _fail(where, name, str(error))
  return DomainSpec(name=name, kind=kind, target=target, reward=reward, weight=float(row["weight"]),
                    priority=values["priority"], quota=float(values["quota"]),
                    timeout_s=float(values["timeout_s"]), max_turns=values["max_turns"],
                    difficulty=values["difficulty"], runtime=values["runtime"], sources=values["sources"])


def load_domains(path: str, *, rewards: Container[str] | None = None) -> list[DomainSpec]:
  """The domains of a JSONL file (blank lines skipped); ValueError naming file:line, domain, field."""
  if rewards is None:
    from meshrl.rl.rewards import VERIFIERS  # pylint: disable=import-outside-toplevel
    rewards = VERIFIERS
  if not os.path.isfile(path):
    raise ValueError(f"data.domains={path!r}: no such file.")
  specs, base = [], os.path.dirname(os.path.abspath(path))
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error}).") from None
      specs.append(parse_domain(row, where, base, rewards))
  names = [s.name for s in specs]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise ValueError(f"{path}: domain name(s) {duplicates[:5]} declared twice.")
  if not specs:
    raise ValueError(f"{path}: declares no domains.")
  check_quotas({s.name: s.policy for s in specs})
  return specs


def _pool(spec: DomainSpec) -> tuple[list[dict], dict]:
  """(examples, {task: reason} of broken ones) of a jsonl or tasks domain, stamped with the domain."""
  if spec.kind == "jsonl":
    loaded = load_jsonl(spec.target)
    rows = [{**row, "task_id": str(row.get("id", "")) or None} for row in loaded.examples]
    broken = {f"line {n}": "malformed row" for n in loaded.bad_lines}
  else:
    tasks, broken = load_tasks([spec.target])
    rows = [task.example() for task in tasks]
  rows = [{**row, "domain": spec.name, "verifier": spec.reward, "max_turns": spec.max_turns,
           "timeout_s": spec.timeout_s, **({"runtime": spec.runtime} if spec.kind == "tasks" else {})}
          for row in rows]
  return rows, broken


class DomainMixture:
  """Random-access mixture over registry domains (see the module docstring).

  Args:
    specs: the domains (`load_domains`).
    seed: example i draws from default_rng([seed, i, attempt]).
    split: "all", "train" or "eval" (hash split of prompts, as TaskMixture).
    eval_fraction: held-out share of the prompt space (0 < f < 1 unless split == "all").
    quarantine: task ids never drawn (a set or rl/envs/quality.Quarantine, read at every draw).
    batch_size: when set, each run of batch_size examples is composed by `plan_batch` (quotas).
    curriculum: {task_id: "always_solved" | "never_solved"} from the quality gate's report
      (`load_curriculum`): such tasks are drawn `flagged_weight` times as often as the others of
      their domain (a floor, never zero: a policy that improves still meets them).
  """

  def __init__(self, specs: Sequence[DomainSpec], *, seed: int = 0, split: str = "all",
               eval_fraction: float = 0.0, quarantine: Container[str] = frozenset(),
               batch_size: int | None = None, curriculum: Mapping[str, str] | None = None,
               flagged_weight: float = FLAGGED_WEIGHT):
    if split not in ("all", "train", "eval"):
      raise ValueError(f"split={split!r}; choose all, train or eval.")
    if not (isinstance(flagged_weight, (int, float)) and 0 < flagged_weight <= 1):
      raise ValueError(f"flagged_weight={flagged_weight!r} must lie in (0, 1]: flagged tasks are "
                       f"drawn less, never not at all.")
    curriculum = dict(curriculum or {})
    unknown = sorted({str(f) for f in curriculum.values()} - set(CURRICULUM_FLAGS))
    if unknown:
      raise ValueError(f"curriculum flags {unknown} are unknown; the gate writes {list(CURRICULUM_FLAGS)}.")
    self.curriculum, self.flagged_weight = curriculum, float(flagged_weight)
    if split != "all" and not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"data.eval_fraction={eval_fraction} must lie strictly between 0 and 1.")
    self.seed, self.split, self.eval_fraction = seed, split, float(eval_fraction)
    self.quarantine, self.batch_size = quarantine, batch_size
    self.broken: dict[str, dict] = {}
    self.pools: dict[str, list[dict]] = {}
    self._pool_probs: dict[str, np.ndarray] = {}
    self.specs: dict[str, DomainSpec] = {}
    for spec in specs:
      if spec.kind != "generator":
        rows, broken = _pool(spec)
        if broken:
          self.broken[spec.name] = broken
        rows = [r for r in rows if self.allowed(r)]
        if not rows:
          continue  # nothing of this domain on this side (or all quarantined): left out, see .dropped
        self.pools[spec.name] = rows
        weights = np.array([self.flagged_weight if r.get("task_id") in self.curriculum else 1.0
                            for r in rows])
        self._pool_probs[spec.name] = weights / weights.sum()
      self.specs[spec.name] = spec
    self.dropped = sorted({s.name for s in specs} - set(self.specs))
    if not self.specs:
      raise ValueError(f"no domain has examples on the {split} side (dropped: {self.dropped[:5]}).")
    self.names = sorted(self.specs)
    weights = np.array([self.specs[n].weight for n in self.names], np.float64)
    self.probs = weights / weights.sum()
    self.policies = {n: self.specs[n].policy for n in self.names}
    self._plans: dict[int, list[str]] = {}

  def _side_ok(self, example: dict) -> bool:
    if self.split == "all":
      return True
    return in_eval_split(example["prompt"], self.eval_fraction) == (self.split == "eval")

  def allowed(self, example: dict) -> bool:
    """On this mixture's side of the split and not quarantined (now)."""
    return self._side_ok(example) and example.get("task_id") not in self.quarantine

  def _domain_of(self, index: int, rng: np.random.Generator) -> str:
    if self.batch_size is None:
      return self.names[int(rng.choice(len(self.names), p=self.probs))]
    batch, slot = divmod(index, self.batch_size)
    if batch not in self._plans:
      if len(self._plans) > 64:
        self._plans.clear()
      self._plans[batch] = plan_batch(self.policies, self.batch_size,
                                      np.random.default_rng([self.seed, 1 << 20, batch]))
    return self._plans[batch][slot]

  def draw(self, name: str, rng: np.random.Generator) -> dict:
    """One example of domain `name` (no split or quarantine check)."""
    spec = self.specs[name]
    if spec.kind == "generator":
      example = make_example(spec.target, rng, difficulty=spec.difficulty)
      return {**example, "domain": name, "verifier": spec.reward, "max_turns": spec.max_turns,
              "timeout_s": spec.timeout_s}
    pool = self.pools[name]
    return dict(pool[int(rng.choice(len(pool), p=self._pool_probs[name]))])

  def __getitem__(self, index: int) -> dict:
    if index < 0:
      raise IndexError(f"index={index} must be >= 0.")
    # Not [seed, index]: numpy seeds [s, i] and [s, i, 0] give the same stream, so the domain's
    # choice and the example's first draw would be the same uniform number.
    name = self._domain_of(index, np.random.default_rng([self.seed, index, 1 << 22]))
    for attempt in range(1000):
      example = self.draw(name, np.random.default_rng([self.seed, index, attempt]))
      if self.allowed(example):
        return example
    raise ValueError(f"domain {name!r}: no {self.split} example outside the quarantine in 1000 draws "
                     f"for index {index}.")

  def __iter__(self) -> Iterator[dict]:
    index = 0
    while True:
      yield self[index]
      index += 1

  def take(self, count: int, *, start: int = 0) -> list[dict]:
    return [self[i] for i in range(start, start + count)]

  def held_out(self, per_domain: int) -> list[dict]:
    """Up to `per_domain` distinct examples of every domain (use on split="eval"), domain by domain.
    A domain's examples depend on (seed, its name, its spec), not on the other domains of the file:
    a run of one domain alone is evaluated on the prompts the joint run evaluates it on."""
    examples = []
    for name in self.names:
      examples += distinct_examples(_DomainView(self, name), per_domain, max_draws=20 * per_domain)
    return examples


def _name_key(name: str) -> int:
  """A stable 63-bit key of a domain's name (the same in every process, unlike hash())."""
  return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big") >> 1


class _DomainView:
  """Random access to one domain of a mixture (its split and quarantine honoured)."""

  def __init__(self, mixture: DomainMixture, name: str):
    self.mixture, self.name, self.key = mixture, name, _name_key(name)

  def __getitem__(self, index: int) -> dict:
    m = self.mixture
    for attempt in range(1000):
      example = m.draw(self.name, np.random.default_rng([m.seed, 1 << 21, self.key, index, attempt]))
      if m.allowed(example):
        return example
    raise ValueError(f"domain {self.name!r}: no {m.split} example in 1000 draws.")


def load_curriculum(path: str) -> dict[str, str]:
  """{task_id: flag} of a quality-gate report (scripts/env_qa.py --json); ValueError naming the file."""
  try:
    with open(path, encoding="utf-8") as handle:
      report = json.load(handle)
  except (OSError, ValueError) as error:
    raise ValueError(f"curriculum report {path}: {error}") from None
  flags = report.get("curriculum") if isinstance(report, dict) else None
  if not isinstance(flags, dict):
    raise ValueError(f"curriculum report {path}: no 'curriculum' object (write it with "
                     f"scripts/env_qa.py and a policy).")
  return {str(k): str(v) for k, v in flags.items()}


def write_many_domains(path: str, count: int = 300, *, seed: int = 0) -> list[dict]:
  """A `count`-domain file over the generated families, varied weights, priorities, quotas and
  difficulties (for the 300-domain mixture test and benchmarks); returns the rows."""
  rng = np.random.default_rng(seed)
  families = sorted(n for n in DOMAINS if n != "code")
  rows = []
  for i in range(count):
    family = families[i % len(families)]
    row = {"name": f"{family}_{i:03d}", "source": f"generator:{family}",
           "reward": DOMAINS[family].verifier,
           "weight": round(float(rng.lognormal(0.0, 1.0)), 3), "priority": int(rng.integers(0, 3)),
           "difficulty": int(rng.integers(1, DOMAINS[family].levels + 1))}
    if i % 50 == 0:
      row["quota"] = 0.02
    rows.append(row)
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  return rows


def check_single_turn(specs: Sequence[DomainSpec]) -> list[DomainSpec]:
  """`specs`, after checking the single-turn RL loop can score them: terminal task domains need the
  multi-turn rollout (issue 11, part 2), which rl/step/program.py does not run yet."""
  from meshrl.rl.rewards import VERIFIERS  # pylint: disable=import-outside-toplevel
  terminal = [s.name for s in specs if s.reward == TERMINAL_REWARD and TERMINAL_REWARD not in VERIFIERS]
  if terminal:
    raise ValueError(f"data.domains: domain(s) {terminal[:5]} use reward {TERMINAL_REWARD!r} (terminal "
                     f"task directories), which the single-turn RL step cannot score yet.")
  return list(specs)


def held_out_from_file(path: str, *, count: int, seed: int, eval_fraction: float,
                       quarantine: Container[str] = frozenset()) -> list[dict]:
  """About `count` held-out examples of a registry file, the same number from every domain (at least
  one each): what evaluation reports per domain as eval/<metric>/<domain>."""
  mixture = DomainMixture(check_single_turn(load_domains(path)), seed=seed, split="eval",
                          eval_fraction=eval_fraction, quarantine=quarantine)
  return mixture.held_out(max(1, count // len(mixture.names)))
