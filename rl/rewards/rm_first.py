"""The reward model an RL run trains before its first step (rm.train_before_rl): scripts/rl.py calls
`ensure_reward_model` before the driver, so one command trains (or reuses) the reward model at
rl.reward_model_checkpoint and then runs RL against it (configs/tiny_rm.py).

  status = ensure_reward_model(cfg, workdir, overwrite=False)   # "off", "reused", "trained" or WARM_STARTED
  policy_cfg, mesh, model, tokenizer = warm_start(cfg, folder)  # the driver's warm start, run before it

What the folder rl.reward_model_checkpoint holds decides:
  nothing of a run                        the reward model is trained there (rl/rewards/rm_job.py: the
                                          policy's model.* with a score head, rm.*, its pairs)
  a reward model of the same settings     reused as it is, when its checkpoint reached rm.steps;
                                          resumed from its checkpoint when it stopped earlier
  anything else                           refused, one line naming the folder and the first setting
                                          that differs (model shape, tokenizer, rm.*, the pairs'
                                          data.* or seed), or what it holds instead (another kind
                                          of run, a Hugging Face folder); nothing is written or
                                          removed: the run never deletes what it did not create.
"The same settings" is rl/rewards/rm_job.SETTINGS (rm.train_jsonl by its path: a preference file edited
in place is not noticed; give the new reward model another folder). Before anything is written, the
RL run's own checks run too (its config with the reward model set aside, its work directory), so a
bad RL setting is not found only after the reward model has trained.

With rm.pairs_from="policy" the reward model is trained on the warm-started policy's own samples
(rl/rewards/policy_pairs.py), so the warm start (rl.sft_steps) runs first, here: into the RL run's own
<workdir>/sft when checkpoints are on (the driver then resumes it at its last step: it is trained
once; with --overwrite the earlier run's outputs are removed first, as the driver would, and the
status is WARM_STARTED so the driver is not told to remove them again), else in a temporary folder
removed afterwards (the driver trains the same warm start again: same seed, same data).
"""

from __future__ import annotations

import os
import tempfile

import ml_collections

from meshrl.rl.rewards.sources import FIELD as SOURCES_FIELD, DomainSources, domain_sources, parse_sources
from meshrl.train.checkpoint import committed_steps
from meshrl.rl.rewards.rm_job import (needs_policy, prepare_reward_model, reward_model_config, saved_run_config,
                                      settings_diff, train_reward_model)
from meshrl.train.workdir import check_workdir, clear_outputs, run_outputs

FIELD = "rl.reward_model_checkpoint"
SWITCH = "rm.train_before_rl"
WARM_STARTED = "trained on the warm start"  # ensure_reward_model: the RL run's sft/ is written (and resumed)


def warm_start(cfg, folder: str, mesh=None):
  """(cfg, mesh, warm-started nnx model, tokenizer): the driver's warm start (rl/step/driver.warm_start:
  rl.sft_steps of SFT from the initial model on the training source at rl.sft_difficulty) run into
  `folder` (train/sft.run_sft: it resumes a checkpoint there)."""
  # pylint: disable=import-outside-toplevel  (the driver imports the whole RL stack)
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.step import driver
  from meshrl.sharding import make_mesh
  from meshrl.train.init_from import initial_model
  mesh = make_mesh(cfg.mesh) if mesh is None else mesh
  tokenizer = tokenizer_from_config(cfg)
  print(f"warm start for the reward model's pairs: {cfg.rl.sft_steps} SFT steps into {folder}")
  result = driver.warm_start(cfg, folder, mesh=mesh, model=initial_model(cfg, mesh), source=driver.train_source(cfg),
                             tokenizer=tokenizer)
  return cfg, mesh, result.model, tokenizer


def temporary_warm_start(cfg):
  """`warm_start` in a temporary folder, removed after (checkpoints off, or scripts/train_rm.py)."""
  with tempfile.TemporaryDirectory(prefix="meshrl_warm_start_") as folder:
    return warm_start(cfg, folder)


def _spec(sources: DomainSources) -> str:
  """rl.reward_sources text of `sources`."""
  terms = lambda t: ",".join(f"{name}:{weight}" for name, weight in t)  # noqa: E731
  return ";".join([f"{d}={terms(t)}" for d, t in sources.by_domain] + [f"*={terms(sources.default)}"])


def _without_reward_model(sources: DomainSources) -> str:
  """rl.reward_sources with every reward_model term scored by the verifier instead (weights kept)."""
  def swap(terms):
    merged = {}
    for name, weight in terms:
      name = "verifier" if name == "reward_model" else name
      merged[name] = merged.get(name, 0.0) + weight
    return tuple(merged.items())
  return _spec(DomainSources(tuple((d, swap(t)) for d, t in sources.by_domain), swap(sources.default)))


def check_rl_run(cfg, workdir: str, *, overwrite: bool = False) -> None:
  """The RL run's checks that do not need the reward model (rl/step/driver.check_config with the
  reward_model source scored by the verifier, and its work directory); reads only. The data.domains
  registry's own "sources" cannot be set aside: with such a registry the driver checks later."""
  # pylint: disable-next=import-outside-toplevel  (the driver imports the whole RL stack)
  from meshrl.rl.step import driver
  from meshrl.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  if parse_sources(cfg.rl.reward_sources) == domain_sources(cfg):  # no registry sources
    aside = ml_collections.ConfigDict(cfg.to_dict())
    aside.rl.reward_sources = _without_reward_model(parse_sources(cfg.rl.reward_sources))
    aside.rl.reward_model_checkpoint = ""
    aside.lock()
    driver.check_config(aside, make_mesh(cfg.mesh).size)
  step_dirs = [os.path.join(folder, str(committed_steps(folder)[-1]))
               for folder in (os.path.join(workdir, "checkpoints"), os.path.join(workdir, "sft", "checkpoints"))
               if committed_steps(folder)]
  resuming = bool(cfg.checkpoint.enabled and cfg.checkpoint.restore and step_dirs and not overwrite)
  check_workdir(workdir, cfg, resuming=resuming, overwrite=overwrite)


def folder_state(path: str, rm_cfg) -> str:
  """"empty", "partial" (a run of these settings, short of rm.steps; "partial-unsaved" when it has
  no checkpoint yet) or "done" for the reward-model folder `path`; ValueError naming `path` when it
  holds anything else. Reads only."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{FIELD}={path!r} is a file; {SWITCH}=true trains the reward model into a folder "
                     f"there: point {FIELD} at a folder, or set {SWITCH}=false to load the file as it is.")
  found = run_outputs(path)
  if not found:
    return "empty"
  saved = saved_run_config(path)
  if not saved or not isinstance(saved.get("rm"), dict) or not isinstance(saved.get("model"), dict):
    raise ValueError(f"{FIELD}={path!r} holds {', '.join(found)} but no reward-model run of meshrl (a Hugging "
                     f"Face folder, or another kind of run?): with {SWITCH}=true point {FIELD} at a new folder, "
                     f"or set {SWITCH}=false to load what is there as the reward model; nothing was changed.")
  diffs = settings_diff(saved, rm_cfg)
  if diffs:
    field, theirs, mine = diffs[0]
    more = f" (and {len(diffs) - 1} more setting{'s' * (len(diffs) > 2)})" if len(diffs) > 1 else ""
    raise ValueError(f"{FIELD}={path!r} holds a reward model trained with other settings: {field}={theirs!r} "
                     f"there, {mine!r} here{more}; point {FIELD} at a new folder (or remove that one "
                     f"yourself), or set {SWITCH}=false to use it as it is; nothing was changed.")
  steps = committed_steps(os.path.join(path, "checkpoints"))
  if not steps:
    return "partial-unsaved"
  return "done" if steps[-1] >= rm_cfg.rm.steps else "partial"


def ensure_reward_model(cfg, workdir: str, *, overwrite: bool = False) -> str:
  """With rm.train_before_rl, the reward model at rl.reward_model_checkpoint trained or reused (see
  the module docstring) -> "trained" or "reused"; "off" without it. Every refusal (this config, the
  RL run's checks, the folder) comes before anything is written. `workdir`, `overwrite`: the RL
  run's (its work directory is checked, not written)."""
  if not cfg.rm.train_before_rl:
    return "off"
  path = cfg.rl.reward_model_checkpoint
  if not path:
    raise ValueError(f"{SWITCH}=true trains the reward model into {FIELD}: set it (a folder, e.g. "
                     f"{os.path.join(workdir, 'reward_model')}).")
  if not domain_sources(cfg).uses("reward_model"):
    raise ValueError(f"{SWITCH}=true but no domain of {SOURCES_FIELD}={cfg.rl.reward_sources!r} (or of "
                     "data.domains) uses 'reward_model': name it there (e.g. '*=reward_model').")
  if os.path.abspath(path) == os.path.abspath(workdir):
    raise ValueError(f"{FIELD}={path!r} is the RL run's work directory; the reward model needs a folder of "
                     f"its own (e.g. {os.path.join(workdir, 'reward_model')}).")
  check_rl_run(cfg, workdir, overwrite=overwrite)
  rm_cfg = reward_model_config(cfg)
  state = folder_state(path, rm_cfg)
  if state == "done":
    print(f"reward model: {path} (trained with these settings; reused)")
    return "reused"
  # A run of these settings stopped before its first checkpoint: its records are redone, as the
  # driver redoes a run of the same config (train/workdir.check_workdir); nothing else is replaced.
  in_workdir = needs_policy(rm_cfg) and cfg.checkpoint.enabled and cfg.checkpoint.restore

  def warm():
    if not in_workdir:
      return temporary_warm_start(cfg)
    if overwrite:  # what the driver's --overwrite removes, removed before the warm start writes there
      clear_outputs(workdir, check_workdir(workdir, cfg, resuming=False, overwrite=True))
    return warm_start(cfg, os.path.join(workdir, "sft"))
  job = prepare_reward_model(rm_cfg, path, overwrite=state == "partial-unsaved", warm_policy=warm)
  print(f"reward model: training into {path} ({rm_cfg.rm.steps} steps, {SWITCH}=true)")
  result = train_reward_model(job)
  evals = [r for r in result.history if "eval/pairwise_accuracy" in r]
  if evals:
    print(f"reward model: held-out pairwise accuracy {evals[0]['eval/pairwise_accuracy']:.3f} (step "
          f"{evals[0]['step']}) -> {evals[-1]['eval/pairwise_accuracy']:.3f} (step {evals[-1]['step']})")
  return WARM_STARTED if in_workdir else "trained"
