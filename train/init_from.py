"""Where a run's first parameters come from: `model.init_from` (and a check of `model.tokenizer`).

  check_initial_model(cfg)             # cheap: reads a few JSON files, compiles and writes nothing
  model = initial_model(cfg, mesh)     # parameters born in their shardings on `mesh`
  mc = model_config(cfg, mesh)         # a model job's numbers (SFT, reward model, judge): built here

`model.init_from` is one of:
  ""                     random init (model/init.py `build_model`, seeded by cfg.seed);
  a Hugging Face folder  config.json of a supported architecture (Qwen3-MoE, DeepSeek-V3) and its
                         safetensors, read slice by slice into the shardings (model/convert.py);
                         cfg's model.* / moe.* must equal what its config.json decides;
  a meshrl checkpoint    a `checkpoints/` folder of train/checkpoint.py (or the work directory
                         holding it): the latest step's params and non-trained variables (router
                         bias) are read straight into the current mesh's shardings; its optimizer
                         state is left behind. The checkpoint's saved config must agree with cfg
                         on every architecture field.

Every bad input is a ValueError naming the field (`model.init_from`, `model.tokenizer`,
`model.vocab_size`) and the value, raised by `check_initial_model` before anything is compiled.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshrl.model import convert
from meshrl.model.init import build_model
from meshrl.model.params import state_shardings
from meshrl.model.tokenizer import tokenizer_from_config
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding.rules import TRAIN_RULES, Rules
from meshrl.train.checkpoint import check_readable, from_nested_dict, to_nested_dict, unreadable

SAMPLE_PROMPT = "What is 12+7?"  # rendered by the chat template to check that it renders
# Fields a checkpoint may differ in from the run: how the model computes or is trained, not what
# its parameters mean. Every other model.* / moe.* field must match.
_RUN_FIELDS = frozenset({
    "model.init_from", "model.tokenizer", "model.value_head", "model.dtype", "model.param_dtype",
    "model.remat", "model.scan_layers", "model.decode_layers", "model.init_std", "model.max_seq_len", "moe.dispatch",
    "moe.capacity_factor", "moe.aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate"})


def checkpoint_steps(folder: str) -> list[int]:
  """The committed checkpoint steps in `folder` (orbax names each step's folder by its number)."""
  if not os.path.isdir(folder):
    return []
  return sorted(int(name) for name in os.listdir(folder)
                if name.isdigit() and os.path.isdir(os.path.join(folder, name, "state")))


def checkpoint_dir(path: str) -> str | None:
  """The folder of step checkpoints that `path` is or holds (`path/checkpoints`), or None; absolute
  for a local path (orbax restores from absolute paths only)."""
  for folder in (path, os.path.join(path, "checkpoints")):
    if checkpoint_steps(folder):
      return folder if "://" in folder else os.path.abspath(folder)
  return None


def _source_kind(cfg) -> str:
  """"random", "hf" or "checkpoint"; ValueError when model.init_from is none of them."""
  path = cfg.model.init_from
  if not path:
    return "random"
  if not os.path.exists(path):
    raise ValueError(f"model.init_from={path!r} does not exist.")
  if checkpoint_dir(path) is not None:
    return "checkpoint"
  if os.path.isfile(os.path.join(path, "config.json")):
    return "hf"
  raise ValueError(f"model.init_from={path!r} is neither a Hugging Face folder (config.json and "
                   "safetensors) nor a meshrl checkpoint (<step>/state, or checkpoints/<step>/state).")


def _flat(config: dict, sections=("model", "moe")) -> dict:
  return {f"{s}.{k}": v for s in sections for k, v in (config.get(s) or {}).items()}


def _check_hf(cfg) -> None:
  path = cfg.model.init_from
  try:
    convert.hf_fields(path)  # supported architecture and features
    convert.check_config_matches(cfg, path)
  except ValueError as e:
    raise ValueError(f"model.init_from={path!r}: {e}") from None
  if not any(os.path.isfile(os.path.join(path, f))
             for f in ("model.safetensors", "model.safetensors.index.json")):
    raise ValueError(f"model.init_from={path!r} has a config.json but no model.safetensors or "
                     "model.safetensors.index.json.")


def saved_config(folder: str, step: int) -> dict:
  """The resolved config saved with checkpoint `step` of `folder` ({} when absent)."""
  path = os.path.join(folder, str(step), "config", "metadata")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _check_checkpoint(cfg) -> None:
  path = cfg.model.init_from
  folder = checkpoint_dir(path)
  step = checkpoint_steps(folder)[-1]
  check_readable(os.path.join(folder, str(step)))  # damaged: names the intact step before it
  saved = _flat(saved_config(folder, step))
  mine = _flat(cfg.to_dict())
  wrong = [f"{key}={mine[key]!r} (checkpoint: {saved[key]!r})" for key in sorted(mine)
           if key not in _RUN_FIELDS and key in saved and saved[key] != mine[key]]
  if wrong:
    raise ValueError(f"model.init_from={path!r}: step {step} was saved with another model: "
                     f"{', '.join(wrong)}.")


def check_tokenizer(cfg) -> None:
  """`model.tokenizer` loads, fits `model.vocab_size` and its chat template renders."""
  tokenizer = tokenizer_from_config(cfg)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.tokenizer={cfg.model.tokenizer!r} has {tokenizer.vocab_size} tokens, more "
                     f"than model.vocab_size={cfg.model.vocab_size} can embed.")
  try:
    prompt = tokenizer.render_prompt(SAMPLE_PROMPT)
  except ValueError as e:
    raise ValueError(f"model.tokenizer={cfg.model.tokenizer!r}: {e}") from None
  if not tokenizer.encode(prompt):
    raise ValueError(f"model.tokenizer={cfg.model.tokenizer!r}: the prompt {SAMPLE_PROMPT!r} "
                     f"renders to {prompt!r}, which encodes to no tokens.")


def check_model_source(cfg) -> None:
  """`model.init_from` exists and holds a model cfg can build (architecture and fields match)."""
  kind = _source_kind(cfg)
  if kind == "hf":
    _check_hf(cfg)
  elif kind == "checkpoint":
    _check_checkpoint(cfg)


def check_initial_model(cfg) -> None:
  """Validates `model.init_from` and `model.tokenizer` without compiling or writing anything."""
  check_model_source(cfg)
  check_tokenizer(cfg)


def _abstract_model(mc: ModelConfig, mesh: Mesh | None, rules: Rules):
  """(graphdef, params, extra) of ShapeDtypeStructs carrying their shardings; nothing allocated."""
  graphdef, params, extra = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))),
                                      nnx.Param, ...)

  def place(state):
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if mesh is None:
      one = SingleDeviceSharding(jax.devices()[0])
      shardings = jax.tree.map(lambda _: one, state, is_leaf=is_variable)
    else:
      shardings = state_shardings(state, mesh, rules)
    return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
                        state, shardings, is_leaf=is_variable)
  return graphdef, place(params), place(extra)


def restore_params(folder: str, mc: ModelConfig, mesh: Mesh | None, *, step: int | None = None,
                   rules: Rules = TRAIN_RULES) -> Transformer:
  """The Transformer of `mc` with the nnx.Params and other variables of checkpoint `step` (default:
  the latest) of `folder`, each array read straight into its sharding on `mesh` under `rules`.

  Reads only the `params` and `extra` parts of the saved TrainState, not its optimizer state. A
  value head the checkpoint lacks (its saved config has model.value_head=false) starts at zero, as
  on Hugging Face import.
  """
  steps = checkpoint_steps(folder)
  if not steps:
    raise ValueError(f"{folder} holds no checkpoint.")
  step = steps[-1] if step is None else step
  graphdef, params, extra = _abstract_model(mc, mesh, rules)
  target = {"params": to_nested_dict(params), "extra": to_nested_dict(extra)}
  head = None
  saved_head = saved_config(folder, step).get("model", {}).get("value_head")
  if "value_head" in target["params"] and saved_head is False:
    head = target["params"].pop("value_head")
  step_dir = os.path.join(folder, str(step))
  check_readable(step_dir)
  try:
    restored = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"), args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  (orbax/tensorstore raise many kinds)
    raise unreadable(step_dir, e) from e
  if head is not None:
    restored["params"]["value_head"] = jax.tree.map(
        lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), head)
  return nnx.merge(graphdef, from_nested_dict(restored["params"], params),
                   from_nested_dict(restored["extra"], extra))


def model_config(cfg, mesh: Mesh | None = None, *, rules: Rules | None = None) -> ModelConfig:
  """The model numbers (a ModelConfig) of a run config on `mesh` (None: without a layout; rules: the
  activations' layout, default the training rules): a model job's (SFT, a reward model, a judge, a
  warm start) and, through rl/step/run_spec.model_numbers, an RL run's under both rule sets. With
  model/convert.py (a Hugging Face folder's config) the only place a config becomes model numbers:
  everything downstream takes them as an argument (tests/test_layout.py keeps it so)."""
  return ModelConfig.from_config(cfg, mesh, rules=rules)


def initial_model(cfg, mesh: Mesh | None, *, rules: Rules = TRAIN_RULES,
                  numbers: ModelConfig | None = None) -> Transformer:
  """The run's first model, every parameter in its sharding on `mesh` (see the module docstring).
  numbers: the run's model numbers on `mesh` (an RL run's spec.model), default `model_config`'s."""
  kind = _source_kind(cfg)
  mc = model_config(cfg, mesh) if numbers is None else numbers
  if kind == "random":
    return build_model(mc, mesh, seed=cfg.seed, rules=rules)
  check_model_source(cfg)
  if kind == "hf":
    return convert.import_checkpoint(cfg.model.init_from, mesh, cfg, rules=rules, numbers=mc)[0]
  return restore_params(checkpoint_dir(cfg.model.init_from), mc, mesh, rules=rules)
