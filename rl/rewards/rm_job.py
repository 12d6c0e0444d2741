"""The reward-model job: a config's preference pairs, every check, then training into a work
directory. `scripts/train_rm.py` runs it; so does `scripts/rl.py` first, when rm.train_before_rl
(rl/rewards/rm_first.py).

  rm_cfg = reward_model_config(cfg)                 # cfg's model with its score head, rm.steps resolved
  job = prepare_reward_model(rm_cfg, workdir)       # every check and the encoded pairs; writes nothing
  job = prepare_reward_model(rm_cfg, workdir, warm_policy=warm)   # rm.pairs_from="policy": warm() after the checks
  result = train_reward_model(job)                  # writes workdir (train/rm_training.py's outputs)
  diffs = settings_diff(saved_config, rm_cfg)       # what makes another reward model: [(field, theirs, mine)]

The reward model is the config's model (model.*, from model.init_from when set) with model.value_head
as its score head: `reward_model_config` sets it, so a policy's config (configs/tiny_rm.py) names the
reward model of its own shape. Pairs come from rm.train_jsonl ({"prompt", "chosen", "rejected",
"margin"?} per line) or, when it is "", are made from the data.tasks mixture: chosen = the task's
answer, rejected = a near miss (or, rm.negatives="policy_errors", a policy's kind of error) the
task's verifier calls wrong. Held-out pairs: rm.eval_jsonl, else
the pairs whose prompts fall in the held-out data.eval_fraction. With rm.pairs_from="policy" (or
"policy+synthetic", added to the file's or the synthetic pairs) the pairs are the warm-started
policy's own samples of training-split prompts, chosen verifier-right and rejected verifier-wrong
(rl/rewards/policy_pairs.py); the caller supplies that policy (`warm_policy`), and the warm start's
settings (rl.sft_*, rl.temperature, the rollout lengths) then make the reward model too (SETTINGS).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import ml_collections

from meshrl.configs import checks
from meshrl.model.tokenizer import tokenizer_from_config
from meshrl.sharding import make_mesh
from meshrl.train import checkpoint, workdir as workdir_lib
from meshrl.train.init_from import check_initial_model, initial_model, model_config
from meshrl.train.optim import check_optim
from meshrl.train.preferences import PairArrays, encode_pairs, read_pairs, split_pairs
from meshrl.train.reward_model import check_score_head
from meshrl.train.rm_calibration import write_calibration
from meshrl.train.rm_source import tokenizer_identity
from meshrl.train.rm_training import RMResult, check_rm_shapes, rm_max_len, rm_optim, run_reward_model

# The settings that make a reward model what it is: another value of any of them trains another one.
# (mesh, log.*, checkpoint.* and the RL run's rl.* / eval.* do not; rm.train_before_rl only says when.)
SETTINGS = ("model", "moe", "attention", "optim", "rm", "seed", "data.tasks", "data.difficulty",
            "data.eval_fraction")
NOT_SETTINGS = frozenset({"rm.train_before_rl", "rm.eval_every", "model.tokenizer"})
# With rm.pairs_from="policy": the warm-started policy that writes the pairs, and how it samples.
POLICY_SETTINGS = ("rl.sft_steps", "rl.sft_learning_rate", "rl.sft_batch_size", "rl.sft_difficulty",
                   "rl.temperature", "rl.max_prompt_len", "rl.max_new_tokens", "data.seq_len")


def reward_model_config(cfg, *, steps: int | None = None) -> ml_collections.ConfigDict:
  """cfg (a policy's or a reward model's config) as the reward model's run: model.value_head=true
  (the score head), rm.steps=`steps` when given, checkpoint.enabled=true (the checkpoint is what an
  RL run loads); locked."""
  rm_cfg = ml_collections.ConfigDict(cfg.to_dict())
  rm_cfg.model.value_head = True
  rm_cfg.checkpoint.enabled = True
  if steps is not None:
    if steps < 1:
      raise ValueError(f"--steps={steps} must be at least 1.")
    rm_cfg.rm.steps = int(steps)
  rm_cfg.lock()
  return rm_cfg


def _flat(config: Any, prefix: str = "") -> dict:
  items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  out = {}
  for key, value in items.items():
    name = f"{prefix}{key}"
    out.update(_flat(value, f"{name}.") if isinstance(value, dict) else {name: value})
  return out


def settings(config: Any) -> dict:
  """{field: value} of the SETTINGS of a config (ConfigDict or a saved dict), the tokenizer by its
  identity (train/rm_source.tokenizer_identity: the same file contents under another path match)."""
  flat = _flat(config)
  policy = "policy" in str(flat.get("rm.pairs_from", "")) or flat.get("rm.init") == "policy"
  names = SETTINGS + (POLICY_SETTINGS if policy else ())
  out = {k: v for k, v in flat.items() if k not in NOT_SETTINGS and any(
      k == s or k.startswith(s + ".") for s in names)}
  out["model.tokenizer"] = tokenizer_identity(str(flat.get("model.tokenizer", "byte")))
  return out


def settings_diff(saved: Any, rm_cfg) -> list[tuple[str, Any, Any]]:
  """[(field, saved value, rm_cfg's value)] where a saved reward model's config differs from the one
  `rm_cfg` trains: model shape and tokenizer first (they decide whether it can be loaded at all)."""
  theirs, mine = settings(saved), settings(rm_cfg)
  missing = object()
  diffs = [(k, theirs.get(k, missing), mine.get(k, missing)) for k in sorted(set(theirs) | set(mine))
           if theirs.get(k, missing) != mine.get(k, missing)]
  diffs = [(k, None if a is missing else a, None if b is missing else b) for k, a, b in diffs]
  return sorted(diffs, key=lambda d: (not d[0].startswith(("model.", "moe.")), d[0]))


def saved_run_config(folder: str) -> dict | None:
  """The config of the reward-model run in `folder`: its latest checkpoint's, else its config.json;
  None when neither reads."""
  steps = checkpoint.committed_steps(os.path.join(folder, "checkpoints"))
  if steps:
    from meshrl.train.init_from import saved_config  # pylint: disable=import-outside-toplevel
    saved = saved_config(os.path.join(folder, "checkpoints"), steps[-1])
    if saved.get("model"):
      return saved
  try:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _file_pairs(cfg):
  """(train, held-out) pairs of rm.train_jsonl (and rm.eval_jsonl)."""
  from meshrl.rl.envs.mixture import in_eval_split  # pylint: disable=import-outside-toplevel
  pairs = read_pairs(cfg.rm.train_jsonl, field="rm.train_jsonl")
  if cfg.rm.eval_jsonl:
    held_out = read_pairs(cfg.rm.eval_jsonl, field="rm.eval_jsonl")
    shared = sorted({p.prompt for p in pairs} & {p.prompt for p in held_out})
    if shared:
      raise ValueError(f"rm.eval_jsonl={cfg.rm.eval_jsonl!r} shares {len(shared)} prompt(s) with "
                       f"rm.train_jsonl, e.g. {shared[0]!r}; held-out prompts must be disjoint.")
    return pairs, held_out
  train, held_out = split_pairs(pairs, lambda prompt: in_eval_split(prompt, cfg.data.eval_fraction))
  for side, name in ((train, "training"), (held_out, "held-out")):
    if not side:
      raise ValueError(f"rm.train_jsonl={cfg.rm.train_jsonl!r}: no pair lands on the {name} side of "
                       f"data.eval_fraction={cfg.data.eval_fraction} (a hash of the prompt); change it "
                       "or give rm.eval_jsonl.")
  return train, held_out


def _synthetic_pairs(cfg):
  """(train, held-out) pairs made from the data.tasks mixture, each side of its prompt split."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.mixture import TaskMixture
  from meshrl.rl.rewards import answer_reward
  from meshrl.train.synthetic_pairs import synthetic_pairs

  def side(split, seed, count):
    mixture = TaskMixture(cfg.data.tasks, difficulty=cfg.data.difficulty, seed=seed, split=split,
                          eval_fraction=cfg.data.eval_fraction)
    return synthetic_pairs(mixture.take(count), seed=seed, origin=f"synthetic {split} example",
                           is_correct=lambda text, example: answer_reward(text, example) >= 1.0,
                           negatives=cfg.rm.negatives)
  return side("train", cfg.seed, cfg.rm.synthetic_pairs), side("eval", cfg.seed + 7919, cfg.rm.eval_pairs)


def needs_policy(cfg) -> bool:
  """Whether the reward model's run needs the warm-started policy: rm.pairs_from names "policy"
  (its samples) or rm.init="policy" (its weights)."""
  return "policy" in cfg.rm.pairs_from or cfg.rm.init == "policy"


def _base_pairs(cfg):
  """(train, held-out) pairs of rm.train_jsonl, else the synthetic ones when rm.pairs_from names
  them, else none (rm.pairs_from="policy" alone)."""
  if cfg.rm.train_jsonl:
    return _file_pairs(cfg)
  if "synthetic" in cfg.rm.pairs_from:
    return _synthetic_pairs(cfg)
  return [], []


class RMJob(NamedTuple):
  cfg: ml_collections.ConfigDict  # the reward model's run (reward_model_config)
  workdir: str
  mesh: Any
  train: PairArrays
  held_out: PairArrays
  leftovers: list  # an earlier run's outputs to remove first (overwrite)
  source: str  # where the pairs came from, for the log
  start_params: Any = None  # rm.init="policy": the warm-started policy's nnx.Param state (copied)


def prepare_reward_model(rm_cfg, workdir: str, *, overwrite: bool = False, warm_policy=None) -> RMJob:
  """Every check of a reward-model run and its encoded pairs, before anything is written: the
  config (ValueError naming the field), each preference line (naming file and line), and the work
  directory (train/workdir.check_workdir: another run there is refused unless it is this one
  resumed, or `overwrite`). rm.pairs_from="policy" or rm.init="policy": `warm_policy()` -> (its
  config, mesh, nnx model, tokenizer) is called after those checks (it may write its warm start;
  never into `workdir`)."""
  checks.check_sections(rm_cfg, "run", "moe", "checkpoint", "log", "rm")
  check_score_head(rm_cfg.model)
  model_config(rm_cfg)  # model.*, moe.*, attention.* by building them
  check_optim(rm_optim(rm_cfg), learning_rate=rm_cfg.rm.learning_rate, field="rm.learning_rate")
  mesh = make_mesh(rm_cfg.mesh)
  check_rm_shapes(rm_cfg, mesh)
  check_initial_model(rm_cfg)
  saved = checkpoint.committed_steps(os.path.join(workdir, "checkpoints"))
  resuming = bool(rm_cfg.checkpoint.restore and saved and not overwrite)
  leftovers = workdir_lib.check_workdir(workdir, rm_cfg, resuming=resuming, overwrite=overwrite)
  if resuming:
    checkpoint.check_readable(os.path.join(workdir, "checkpoints", str(saved[-1])))
    checkpoint.check_saved_config(os.path.join(workdir, "checkpoints", str(saved[-1])), rm_cfg)
  # The file's (or synthetic) pairs are read and encoded first: a bad line is refused before the warm start.
  train, held_out = _base_pairs(rm_cfg)
  tokenizer = tokenizer_from_config(rm_cfg)
  encode = lambda pairs: encode_pairs(pairs, tokenizer, max_len=rm_max_len(rm_cfg),  # noqa: E731
                                      overflow=rm_cfg.rm.overflow)
  encode(train), encode(held_out[:rm_cfg.rm.eval_pairs])
  policy = None
  if needs_policy(rm_cfg):
    if warm_policy is None:
      raise ValueError(f"rm.pairs_from={rm_cfg.rm.pairs_from!r}, rm.init={rm_cfg.rm.init!r} need the warm-started "
                       "policy, and none was given: scripts/rl.py and scripts/train_rm.py run its warm start first.")
    policy = warm_policy()
  if "policy" in rm_cfg.rm.pairs_from:  # the policy's pairs first (rm.eval_pairs keeps its held-out ones)
    from meshrl.rl.rewards.policy_pairs import policy_pairs  # pylint: disable=import-outside-toplevel
    policy_train, policy_held_out = policy_pairs(*policy)
    train, held_out = policy_train + train, policy_held_out + held_out
  train_arrays, held_out_arrays = encode(train), encode(held_out[:rm_cfg.rm.eval_pairs])
  source = "rm.train_jsonl" if rm_cfg.rm.train_jsonl else (
      "synthetic, from " + rm_cfg.data.tasks if "synthetic" in rm_cfg.rm.pairs_from else "")
  if "policy" in rm_cfg.rm.pairs_from:
    source = "the warm-started policy's samples" + (f" and {source}" if source else "")
  start_params = None
  if rm_cfg.rm.init == "policy":
    from flax import nnx  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    start_params = jax.tree.map(lambda x: x.copy(), nnx.state(policy[2], nnx.Param))
  return RMJob(rm_cfg, workdir, mesh, train_arrays, held_out_arrays, leftovers, source, start_params)


def train_reward_model(job: RMJob) -> RMResult:
  """Clears `job.leftovers`, writes config.json and trains (train/rm_training.run_reward_model)."""
  from meshrl.configs import save_config  # pylint: disable=import-outside-toplevel
  workdir_lib.clear_outputs(job.workdir, job.leftovers)
  print(f"config: {save_config(job.cfg, job.workdir)}")
  print(f"pairs: {len(job.train)} training, {len(job.held_out)} held out ({job.source})")
  model = initial_model(job.cfg, job.mesh)
  if job.start_params is not None:  # rm.init="policy": every weight but the (zero) score head
    from flax import nnx  # pylint: disable=import-outside-toplevel
    nnx.update(model, job.start_params)
    print("reward model: starts from the warm-started policy (rm.init=policy)")
  result = run_reward_model(job.cfg, job.workdir, job.mesh, model, train=job.train, held_out=job.held_out)
  if len(job.held_out):  # rl.rm_binarize's threshold (train/rm_calibration.py)
    from meshrl.train.reward_model import make_scorer, score_pairs  # pylint: disable=import-outside-toplevel
    from meshrl.sharding.rules import rules_from_config  # pylint: disable=import-outside-toplevel
    rules = rules_from_config(job.cfg.mesh)
    chosen, rejected = score_pairs(make_scorer(result.graphdef, job.mesh, rules), result.state.params,
                                   result.state.extra, job.held_out, batch_size=job.cfg.rm.batch_size,
                                   mesh=job.mesh, rules=rules)
    record = write_calibration(job.workdir, chosen, rejected)
    print(f"reward model: threshold {record['threshold']:.3f} classifies {record['accuracy']:.3f} of the held-out "
          "pairs' sides (rl.rm_binarize)")
  return result
