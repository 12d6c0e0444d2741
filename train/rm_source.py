"""A trained reward model loaded beside a policy: checked against the policy's tokens, then read
straight into its shardings on the policy's mesh.

  rm_cfg = check_reward_model(path, policy_cfg)             # reads JSON only; ValueError naming `field`
  model, rm_cfg = load_reward_model(path, policy_cfg, mesh)
  judge, judge_cfg = load_judge_model(path, policy_cfg, mesh)   # a generative judge: any policy-shaped model

`path` is a meshrl reward-model checkpoint (scripts/train_rm.py's work directory, its checkpoints/
folder) or a Hugging Face `Qwen3MoeForSequenceClassification` folder (model/convert.py). The reward
model reads the policy's token ids, so both must use one tokenizer: the same "byte" tokenizer, or
tokenizer.json files with the same contents (paths may differ), and the reward model's vocabulary
must hold every policy token. Anything else is refused by name (the field, both tokenizers): a
reward model reading another vocabulary's ids scores text nobody wrote.
"""

from __future__ import annotations

import hashlib
import os

import ml_collections
from jax.sharding import Mesh

from meshrl.model import convert
from meshrl.model.tokenizer import tokenizer_from_config
from meshrl.model.transformer import Transformer
from meshrl.sharding.rules import TRAIN_RULES, Rules
from meshrl.train import init_from
from meshrl.train.checkpoint import check_readable

FIELD = "rl.reward_model_checkpoint"
JUDGE_FIELD = "rl.judge_checkpoint"


def _tokenizer_file(name: str) -> str | None:
  """The tokenizer.json that model.tokenizer=`name` reads (None for "byte" or a missing file)."""
  if name == "byte":
    return None
  path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
  return path if os.path.isfile(path) else None


def tokenizer_identity(name: str) -> str:
  """"byte", or "sha256:<digest>" of the tokenizer.json `name` names, or "missing:<name>"."""
  if name == "byte":
    return "byte"
  path = _tokenizer_file(name)
  if path is None:
    return f"missing:{name}"
  with open(path, "rb") as f:
    return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def _saved_rm_config(path: str, policy_cfg, field: str) -> ml_collections.ConfigDict:
  """The reward model's run config: its checkpoint's saved config, or a Hugging Face folder's
  (its own tokenizer files beside it), on the policy's mesh."""
  if not os.path.exists(path):
    raise ValueError(f"{field}={path!r} does not exist.")
  folder = init_from.checkpoint_dir(path)
  if folder is not None:
    step = init_from.checkpoint_steps(folder)[-1]
    check_readable(os.path.join(folder, str(step)))
    saved = init_from.saved_config(folder, step)
    if not saved.get("model"):
      raise ValueError(f"{field}={path!r}: step {step} has no saved config to build the reward model from.")
    rm_cfg = ml_collections.ConfigDict(saved)
  elif os.path.isfile(os.path.join(path, "config.json")):
    try:
      rm_cfg = convert.load_hf_config(path, base=policy_cfg).unlock()
    except ValueError as e:
      raise ValueError(f"{field}={path!r}: {e}") from None
    rm_cfg.model.tokenizer = path
  else:
    raise ValueError(f"{field}={path!r} is neither a meshrl checkpoint (checkpoints/<step>/state) nor a "
                     "Hugging Face folder (config.json and safetensors).")
  rm_cfg.mesh = ml_collections.ConfigDict(policy_cfg.mesh.to_dict())
  return rm_cfg


def _check_policy_tokens(rm_cfg, policy_cfg, path: str, field: str, what: str) -> None:
  """ValueError unless the model of `rm_cfg` (`what`: "reward model", "judge") reads the policy's
  token ids: the same tokenizer, a vocabulary that embeds every policy id."""
  policy_tok, rm_tok = str(policy_cfg.model.tokenizer), str(rm_cfg.model.get("tokenizer", "byte"))
  rm_id = tokenizer_identity(rm_tok)
  if rm_id != tokenizer_identity(policy_tok) or rm_id.startswith("missing:"):
    raise ValueError(f"{field}={path!r}: the {what}'s tokenizer {rm_tok!r} differs from the policy's "
                     f"model.tokenizer={policy_tok!r}; it would read the policy's token ids as other text. "
                     f"Train the {what} with the policy's tokenizer (--config.model.tokenizer).")
  vocab = tokenizer_from_config(policy_cfg).vocab_size
  if rm_cfg.model.vocab_size < vocab:
    raise ValueError(f"{field}={path!r}: the {what}'s model.vocab_size={rm_cfg.model.vocab_size} "
                     f"cannot embed the policy tokenizer's {vocab} ids.")


def check_reward_model(path: str, policy_cfg, *, field: str = FIELD) -> ml_collections.ConfigDict:
  """The reward model's config (locked) after checking that it has a score head and reads the
  policy's tokens; ValueError naming `field`, the path and both tokenizers otherwise. Reads JSON
  and the tokenizer files only."""
  rm_cfg = _saved_rm_config(path, policy_cfg, field)
  if not rm_cfg.model.get("value_head", False):
    raise ValueError(f"{field}={path!r} was saved with model.value_head=False: it has no score head "
                     "(train a reward model with scripts/train_rm.py).")
  _check_policy_tokens(rm_cfg, policy_cfg, path, field, "reward model")
  rm_cfg.lock()
  return rm_cfg


def check_judge_model(path: str, policy_cfg, *, field: str = JUDGE_FIELD) -> ml_collections.ConfigDict:
  """The judge's config (locked): a policy-shaped model (any meshrl checkpoint or Hugging Face
  causal LM folder) that reads the policy's tokens, since its prompt quotes the policy's response;
  ValueError naming `field` otherwise. Reads JSON and the tokenizer files only."""
  judge_cfg = _saved_rm_config(path, policy_cfg, field)
  _check_policy_tokens(judge_cfg, policy_cfg, path, field, "judge")
  judge_cfg.lock()
  return judge_cfg


def _load(path: str, cfg, mesh: Mesh | None, rules: Rules) -> Transformer:
  folder = init_from.checkpoint_dir(path)
  if folder is None:
    return convert.import_checkpoint(path, mesh, cfg, rules=rules)[0]
  return init_from.restore_params(folder, init_from.model_config(cfg, mesh), mesh, rules=rules)


def load_judge_model(path: str, policy_cfg, mesh: Mesh | None, *, field: str = JUDGE_FIELD,
                     rules: Rules = TRAIN_RULES) -> tuple[Transformer, ml_collections.ConfigDict]:
  """(judge model, its config): `check_judge_model`, then its parameters read into their shardings
  on the policy's `mesh` (frozen)."""
  judge_cfg = check_judge_model(path, policy_cfg, field=field)
  return _load(path, judge_cfg, mesh, rules), judge_cfg


def load_reward_model(path: str, policy_cfg, mesh: Mesh | None, *, field: str = FIELD,
                      rules: Rules = TRAIN_RULES) -> tuple[Transformer, ml_collections.ConfigDict]:
  """(reward model, its config): `check_reward_model`, then every parameter read into its sharding
  on `mesh` under `rules` (the policy's mesh; frozen: no optimizer state is read)."""
  rm_cfg = check_reward_model(path, policy_cfg, field=field)
  return _load(path, rm_cfg, mesh, rules), rm_cfg
