"""A difficulty curriculum driven by measured pass rates, per domain and level (issue 33).

  curriculum = LevelCurriculum({"reverse": "reverse"}, start={"reverse": 2}, floor=1, top=4)
  example = curriculum.relevel(example)       # regenerated at the domain's current level
  curriculum.observe(domains, levels, correct) # [B] per-sample outcomes of a step
  curriculum.levels                            # {"reverse": 3} once level 2 was solved

Each governed domain (a generated family of rl/envs/mixture.DOMAINS, named by its family or by a
registry row whose source is that generator) sits at one level. Outcomes are counted per (domain,
level), so samples drawn before a move (asynchronous rollouts, retries) count for the level they were
drawn at. Once the current level has `window` samples since the domain arrived there, its pass rate
decides: >= `promote_at` moves one level up (to `top` at most), <= `demote_at` one level down (never
below `floor`), anything between stays and starts a new window. A move starts a fresh window too.
A lower level is there to give a domain signal: when the floor, below the domain's configured (start)
level, is as hopeless as the level above was (<= `demote_at`), the domain goes back to its start
level and is not sent below it again (its floor becomes that level). A warm start aimed at the hard
level can leave the easier one worse: issue 33's copy, warmed up with 44% of its rows at five symbols,
passed 1.5% at three and was held there for a whole run while RL at five took it to 100%.

`relevel` keeps the mixture's choice of domain (its weights and quotas) and regenerates the prompt at
the domain's level with a generator seeded by (seed, host, the number of examples relevelled so far), so a
run is reproducible, and a resumed one continues exactly (`get_state` / `set_state`). With a held-out
split the regenerated prompt is drawn again until it lies on the train side (`in_eval_split`): training
never sees a held-out prompt at any level.

The warm start can train at another level than RL and evaluation (rl.sft_difficulty): `warm_start_source`
wraps the run's training source so its generated domains' examples are regenerated at that level
(`AtLevel`, random access, on the train side of the held-out split); file rows pass unchanged. The mix
may differ per domain ("copy=1:1,2:0.8;*=1:1,2:0.03"): a domain whose harder level comes in a sharp
jump of SFT (copy here: no sampled success with 23% of its rows at level 2, in 3 seeds; greedy right
on 7-96% of held-out prompts with 33-44%, by seed) can get the share that leaves it at its first
successes while the others keep theirs.

Pure Python and numpy: no jax.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from meshrl.rl.envs.mixture import DOMAINS, in_eval_split
from meshrl.rl.envs.registry import load_domains
from meshrl.rl.rewards.compose import parse_weights

_STREAM = 33  # folded into the relevel generator's seed, apart from the mixture's own draws
_WARM_STREAM = 34  # the same for the warm start's examples (AtLevel)


def generated_domains(cfg) -> tuple[dict[str, str], dict[str, int]]:
  """The run's generated domains {name: family} and their configured levels {name: level}:
  data.domains' generator rows, else the families of data.tasks at data.difficulty."""
  if cfg.data.domains:
    specs = [s for s in load_domains(cfg.data.domains) if s.kind == "generator"]
    return {s.name: s.target for s in specs}, {s.name: s.difficulty for s in specs}
  weighted = parse_weights(cfg.data.tasks, field="data.tasks") if cfg.data.tasks.strip() else []
  names = [name for name, _ in weighted if name in DOMAINS]
  return {n: n for n in names}, {n: int(cfg.data.difficulty) for n in names}


def governed_domains(names: str, available: Mapping[str, str], *, field: str) -> dict[str, str]:
  """{domain: generator family} of the comma-separated `names` ("all": every one of `available`,
  the run's generated domains {name: family}, none when it has none: a preset's "all" works unchanged
  on file rows); an unknown name is a ValueError naming `field`."""
  if names.strip() == "all":
    return dict(available)
  chosen = {}
  for name in (n.strip() for n in names.split(",")):
    if not name:
      continue
    if name not in available:
      raise ValueError(f"{field}={names!r}: {name!r} is not a generated domain of this run; choose from "
                       f"{sorted(available)} (or 'all').")
    chosen[name] = available[name]
  if not chosen:
    raise ValueError(f"{field}={names!r} names no domain.")
  return chosen


def check_levels(families: Mapping[str, str], *, floor: int, top: int, start: Mapping[str, int],
                 field: str) -> None:
  """ValueError naming `field` unless every family has levels floor..top (top 0: its own top) and
  every start level lies there."""
  for name, family in families.items():
    levels = DOMAINS[family].levels
    if not 1 <= floor <= levels:
      raise ValueError(f"{field}_floor={floor}: domain {name!r} ({family}) has levels 1..{levels}.")
    if top and not floor <= top <= levels:
      raise ValueError(f"{field}_max={top}: domain {name!r} ({family}) has levels 1..{levels} and the floor "
                       f"is {floor} (0 = each family's top level).")
    first = start.get(name, floor)
    if first < floor:
      raise ValueError(f"{field}_floor={floor}: domain {name!r} starts below it, at level {first} "
                       "(data.difficulty or its data.domains row).")
    if first > (top or levels):
      raise ValueError(f"{field}_max={top}: domain {name!r} starts above it, at level {first} "
                       "(data.difficulty or its data.domains row).")


class LevelCurriculum:
  """The current level of each governed domain and the outcomes counted per (domain, level).

  Args:
    families: {domain name: generator family} of the governed domains.
    start: {domain: first level} (clamped into floor..top); missing: `floor`.
    floor / top: the lowest and highest levels (top 0: each family's own top level).
    promote_at / demote_at: pass rates (over `window` samples at the current level) that move a
      domain up / down one level.
    seed: the run's seed (relevelled prompts); shard: this host's index when each host draws its own
      prompts (0 when every host draws the same stream), so hosts relevel to different prompts.
    eval_fraction: > 0 when held-out prompts are the hash
      split's eval side (relevelled prompts are kept on the train side).
  """

  def __init__(self, families: Mapping[str, str], *, start: Mapping[str, int] | None = None, floor: int = 1,
               top: int = 0, promote_at: float = 0.7, demote_at: float = 0.02, window: int = 64,
               seed: int = 0, shard: int = 0, eval_fraction: float = 0.0):
    if not 0.0 <= demote_at < promote_at <= 1.0:
      raise ValueError(f"demote_at={demote_at} and promote_at={promote_at} must satisfy "
                       "0 <= demote_at < promote_at <= 1.")
    if window < 1:
      raise ValueError(f"window={window} must be at least 1.")
    self.families = dict(families)
    self.floor = int(floor)
    self.top = {name: int(top) or DOMAINS[family].levels for name, family in self.families.items()}
    self.promote_at, self.demote_at, self.window = float(promote_at), float(demote_at), int(window)
    self.seed, self.shard, self.eval_fraction = int(seed), int(shard), float(eval_fraction)
    start = dict(start or {})
    self.levels = {name: int(np.clip(start.get(name, self.floor), self.floor, self.top[name]))
                   for name in self.families}
    self.start = dict(self.levels)  # the configured levels
    self.floors = {name: self.floor for name in self.families}  # raised when no lower level helped
    self.counts: dict[str, list[int]] = {}  # "domain@level" -> [successes, samples] over the whole run
    self.window_counts = {name: [0, 0] for name in self.families}  # at the current level, since arriving
    self.relevelled = 0
    self.moves = 0

  def relevel(self, example: dict) -> dict:
    """`example` regenerated at its domain's current level (stamped "difficulty"); examples of other
    domains (files, ungoverned families) unchanged."""
    name = example.get("domain")
    if name not in self.families:
      return example
    family, level = DOMAINS[self.families[name]], self.levels[name]
    index, self.relevelled = self.relevelled, self.relevelled + 1
    for attempt in range(1000):
      generated = family.generate(np.random.default_rng([self.seed, _STREAM, self.shard, index, attempt]), level)
      if not self.eval_fraction or not in_eval_split(generated["prompt"], self.eval_fraction):
        return {**example, **generated, "difficulty": level}
    raise ValueError(f"no train-side prompt of domain {name!r} at level {level} in 1000 draws: the train "
                     f"side of data.eval_fraction={self.eval_fraction} is (nearly) empty there.")

  def observe(self, domains: Sequence[str], levels: Sequence[int], correct: np.ndarray) -> list[str]:
    """Counts [B] per-sample outcomes (correct > 0 is a success) at their (domain, level), then moves
    the domains whose current window is full. Returns the moves made ("reverse 2->3")."""
    correct = np.asarray(correct, np.float32)
    for name, level, value in zip(domains, levels, correct):
      if name not in self.families:
        continue
      success = int(value > 0)
      cell = self.counts.setdefault(f"{name}@{int(level)}", [0, 0])
      cell[0] += success
      cell[1] += 1
      if int(level) == self.levels[name]:
        self.window_counts[name][0] += success
        self.window_counts[name][1] += 1
    moves = []
    for name, (wins, samples) in self.window_counts.items():
      if samples < self.window:
        continue
      rate, level = wins / samples, self.levels[name]
      if rate >= self.promote_at and level < self.top[name]:
        self.levels[name] = level + 1
      elif rate <= self.demote_at and level > self.floors[name]:
        self.levels[name] = level - 1
      elif rate <= self.demote_at and level < self.start[name]:  # no lower level gave it signal
        self.levels[name] = self.floors[name] = self.start[name]
      self.window_counts[name] = [0, 0]
      if self.levels[name] != level:
        self.moves += 1
        moves.append(f"{name} {level}->{self.levels[name]}")
    return moves

  def metrics(self) -> dict[str, float]:
    """curriculum/level/<domain>, curriculum/pass_rate/<domain>@<level> (the run's counts) and
    curriculum/moves (so far)."""
    out = {f"curriculum/level/{name}": float(level) for name, level in self.levels.items()}
    out.update({f"curriculum/pass_rate/{key}": wins / samples
                for key, (wins, samples) in sorted(self.counts.items()) if samples})
    out["curriculum/moves"] = float(self.moves)
    return out

  def get_state(self) -> dict:
    """JSON: the levels, floors, counts, windows and the relevel counter."""
    return {"levels": dict(self.levels), "floors": dict(self.floors),
            "counts": {k: list(v) for k, v in self.counts.items()},
            "window": {k: list(v) for k, v in self.window_counts.items()}, "relevelled": self.relevelled,
            "moves": self.moves}

  def set_state(self, state: dict) -> None:
    """Continues from `get_state`'s output; a state of other domains is a ValueError."""
    if set(state["levels"]) != set(self.families):
      raise ValueError(f"the checkpoint's curriculum governs {sorted(state['levels'])}, this run "
                       f"{sorted(self.families)}: resume with the same data.level_curriculum.")
    self.levels = {k: int(v) for k, v in state["levels"].items()}
    self.floors = {k: int(v) for k, v in state.get("floors", {}).items()} or {k: self.floor for k in self.levels}
    self.counts = {k: [int(a), int(b)] for k, (a, b) in state["counts"].items()}
    self.window_counts = {k: [int(a), int(b)] for k, (a, b) in state["window"].items()}
    self.relevelled, self.moves = int(state["relevelled"]), int(state["moves"])


class AtLevel:
  """Random access over `source` (source[i] for i >= 0) with the examples of its generated domains
  regenerated at `levels`: example i is source[i]'s domain (the mixture's weights and quotas kept) at
  a level drawn by the levels' weights, by a generator seeded by (seed, i), drawn again until it lies
  on the train side of `eval_fraction` (> 0: the hash split's held-out side is never trained on).
  Other examples (file rows, ungoverned families, domains `levels` gives no mix) are source[i] as it is.

  Args:
    source: the run's training source (TaskMixture / DomainMixture: rl/step/driver.train_source).
    families: {domain name: generator family} to regenerate (`generated_domains`).
    levels: a level, or [(level, weight)], each within every family's 1..levels, for every domain; or
      {domain: [(level, weight)]} per domain ("*": every domain not named) (`warm_levels`).
  """

  def __init__(self, source, families: Mapping[str, str], levels, *, seed: int = 0, eval_fraction: float = 0.0):
    per_domain = levels if isinstance(levels, Mapping) else {"*": levels}
    self.source, self.families = source, dict(families)
    self.mixes = {}  # domain ("*": the others) -> (levels [L], probabilities [L])
    for name, mix in per_domain.items():
      mix = [(int(mix), 1.0)] if isinstance(mix, (int, np.integer)) else [(int(l), float(w)) for l, w in mix]
      weights = np.array([weight for _, weight in mix], np.float64)
      self.mixes[name] = (np.array([level for level, _ in mix]), weights / weights.sum())
    self.seed, self.eval_fraction = int(seed), float(eval_fraction)

  def __getitem__(self, index: int) -> dict:
    example = self.source[index]
    name = example.get("domain")
    mix = self.mixes.get(name, self.mixes.get("*")) if name in self.families else None
    if mix is None:
      return example
    family, (levels, probs) = DOMAINS[self.families[name]], mix
    rng = np.random.default_rng([self.seed, _WARM_STREAM, int(index)])
    level = int(levels[rng.choice(len(levels), p=probs)]) if len(levels) > 1 else int(levels[0])
    for _ in range(1000):
      generated = family.generate(rng, level)
      if not self.eval_fraction or not in_eval_split(generated["prompt"], self.eval_fraction):
        return {**example, **generated, "difficulty": level}
    raise ValueError(f"no train-side prompt of domain {name!r} at level {level} in 1000 draws: the "
                     f"train side of data.eval_fraction={self.eval_fraction} is (nearly) empty there.")


def _level_mix(spec: str, entry: str, field: str) -> list[tuple[int, float]]:
  """[(level, weight)] of one mix "2" or "1:0.95,2:0.05" (`entry`, a part of `spec`)."""
  parsed = []
  for name, weight in parse_weights(entry, field=field):
    if not name.isdigit() or int(name) < 1:
      raise ValueError(f"{field}={spec!r}: {name!r} is not a level (1, 2, ...); write '2' or '1:0.95,2:0.05'.")
    if not weight > 0:
      raise ValueError(f"{field}={spec!r}: the weight {weight} of level {name} must be positive.")
    parsed.append((int(name), weight))
  return parsed


def warm_levels(cfg):
  """rl.sft_difficulty parsed: [] for "" (the warm start trains at the RL's own levels); [(level,
  weight)] for every generated domain from "2" or "1:0.95,2:0.05"; or, per domain,
  {domain: [(level, weight)]} from "copy=1:1,2:0.8;*=1:1,2:0.03" ("*": every domain not named; a
  domain without an entry keeps its RL level). ValueError naming the field unless every level is one
  of its domains' and the weights are positive, and every named domain is a generated domain of the
  run (a run of file rows alone has none: the setting leaves its rows as they are)."""
  spec = str(cfg.rl.sft_difficulty).strip()
  if not spec or spec == "0":
    return []
  field = "rl.sft_difficulty"
  families, _ = generated_domains(cfg)  # none (file rows only): nothing to regenerate
  if "=" not in spec:
    mixes = {"*": _level_mix(spec, spec, field)}
  else:
    mixes = {}
    for entry in (e.strip() for e in spec.split(";")):
      if not entry:
        continue
      name, eq, mix = (part.strip() for part in entry.partition("="))
      if not eq or not name or not mix:
        raise ValueError(f"{field}={spec!r}: {entry!r} is not 'domain=levels' (e.g. 'copy=1:1,2:0.8;*=1').")
      if name in mixes:
        raise ValueError(f"{field}={spec!r}: domain {name!r} has two entries.")
      if families and name != "*" and name not in families:
        raise ValueError(f"{field}={spec!r}: {name!r} is not a generated domain of this run; choose from "
                         f"{sorted(families)} (or '*').")
      mixes[name] = _level_mix(spec, mix, field)
  for name, family in families.items():
    for level, _ in mixes.get(name, mixes.get("*", [])):
      if level > DOMAINS[family].levels:
        raise ValueError(f"{field}={spec!r}: domain {name!r} ({family}) has levels 1..{DOMAINS[family].levels}.")
  return mixes["*"] if list(mixes) == ["*"] else mixes


def check_warm_start(cfg) -> None:
  """rl.sft_difficulty (`warm_levels`); ValueError naming the field."""
  warm_levels(cfg)


def warm_start_source(cfg, source):
  """The warm start's (rl.sft_steps) examples: `source`, the run's training source, with its
  generated domains at rl.sft_difficulty's levels (`AtLevel`); `source` itself when that is empty."""
  levels = warm_levels(cfg)
  families, _ = generated_domains(cfg)
  if not levels or not families:
    return source
  held_out_by_split = cfg.data.eval_fraction > 0 and not cfg.eval.jsonl  # as driver.train_source
  return AtLevel(source, families, levels, seed=cfg.seed,
                 eval_fraction=cfg.data.eval_fraction if held_out_by_split else 0.0)
