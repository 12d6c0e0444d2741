"""Hugging Face checkpoints in and out: Qwen3-MoE and DeepSeek-V3 <-> meshrl's Transformer.

  cfg = load_hf_config(hf_dir)                          # the run config that checkpoint needs
  model, cfg = import_checkpoint(hf_dir, mesh, cfg)     # parameters born sharded on the mesh
  export_checkpoint(model, cfg, out_dir, "Qwen3MoeForCausalLM")

Reward models: `Qwen3MoeForSequenceClassification` with num_labels=1 (transformers'
`GenericForSequenceClassification`: the decoder, then a bias-free `score` Linear [1, D] read at the
last token that is not the pad id) is meshrl's Transformer with `model.value_head` as the score head
(train/reward_model.py reads it at each row's last token). It has no LM head: on import
`model.tie_embeddings` is true (no lm_head leaf) and on export an untied lm_head is left out;
`pad_token_id` (export's argument) is what transformers needs to find the last token of a batch.

Import never holds the model whole in host memory: each parameter is built with
`jax.make_array_from_callback`, whose callback reads only the device's block of each Hugging Face
tensor (`safe_open(...).get_slice`). The host peak is this host's distinct device blocks of one
parameter: its share of a sharded parameter, a whole stacked [L, ...] parameter when it is replicated
or there is no mesh. Export gathers one layer of one parameter at a time and writes safetensors shards
of at most `max_shard_bytes`; its peak is one shard.

Names (HF `Linear` weights are [out, in] and are transposed to meshrl's [in, out] kernels; stacked
leaves [L, ...] take layer l of their stack from HF layer `first + l`, where `first` is 0 for
`dense_stack` and `moe.first_k_dense` for `moe_stack`):

  embed/embedding                 model.embed_tokens.weight
  final_norm/scale, lm_head       model.norm.weight, lm_head.weight (absent when tied)
  <stack>/attn_norm, mlp_norm     model.layers.{l}.input_layernorm, post_attention_layernorm
  <stack>/attn/X                  model.layers.{l}.self_attn.X (q_a_norm -> q_a_layernorm,
                                  kv_a_norm -> kv_a_layernorm, kv_a_proj -> kv_a_proj_with_mqa)
  value_head/kernel               score.weight (sequence classification; absent from causal LMs)
  dense_stack/mlp/{gate,up,down}  model.layers.{l}.mlp.{gate,up,down}_proj
  moe_stack/mlp/router, router_bias      model.layers.{l}.mlp.gate.weight, e_score_correction_bias
  moe_stack/mlp/{gate,up,down} [L, E..]  model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj
  moe_stack/mlp/shared_{gate,up,down}    model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj

Checks on import: a tensor the model needs and the files lack, or of the wrong shape, raises a
ValueError listing them; so does any tensor meshrl would drop, except DeepSeek's multi-token-
prediction layers (index >= num_hidden_layers), `rotary_emb.inv_freq` buffers and a tied
`lm_head.weight`, which are skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from meshrl.configs.hf_config import (  # noqa: F401  (load_hf_config, hf_fields, ARCHITECTURES: read as convert.X)
    ARCHITECTURES, architecture_of, check_config_matches, hf_architecture, hf_fields, load_hf_config, read_json)
from meshrl.model.params import state_shardings
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding.rules import TRAIN_RULES, Rules

_LOG = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Names: each meshrl leaf and the Hugging Face tensors it is made of.


@dataclasses.dataclass(frozen=True)
class _Source:
  """The HF tensors of one meshrl leaf: `template` has {layer} (and {expert}) fields when stacked."""
  template: str
  transpose: bool  # HF stores [out, in], meshrl [in, out]
  first_layer: int | None = None  # HF index of stack layer 0; None when the leaf is not stacked
  per_expert: bool = False  # a leaf [L, E, ...] made of one HF tensor per expert

  def name(self, layer: int | None = None, expert: int | None = None) -> str:
    return self.template.format(layer=None if layer is None else self.first_layer + layer, expert=expert)

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one HF tensor, given the meshrl leaf's shape."""
    inner = shape[(self.first_layer is not None) + self.per_expert:]
    return tuple(reversed(inner)) if self.transpose else inner

  def names(self, shape: tuple[int, ...]) -> list[str]:
    if self.first_layer is None:
      return [self.template]
    if self.per_expert:
      return [self.name(l, e) for l in range(shape[0]) for e in range(shape[1])]
    return [self.name(l) for l in range(shape[0])]


_TOP = {("embed", "embedding"): _Source("model.embed_tokens.weight", False),
        ("final_norm", "scale"): _Source("model.norm.weight", False)}
_HEADS = {"lm_head": {("lm_head", "kernel"): _Source("lm_head.weight", True)},  # _Architecture.head
          "score": {("value_head", "kernel"): _Source("score.weight", True)}}
_RENAMES = {"attn": "self_attn", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
            "q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm",
            "kv_a_proj": "kv_a_proj_with_mqa", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MOE = {  # moe_stack/mlp/<leaf>: (name under model.layers.{layer}.mlp., transpose, per expert)
    "router": ("gate.weight", True, False),
    "router_bias": ("gate.e_score_correction_bias", False, False),
    "gate": ("experts.{expert}.gate_proj.weight", True, True),
    "up": ("experts.{expert}.up_proj.weight", True, True),
    "down": ("experts.{expert}.down_proj.weight", True, True),
    "shared_gate": ("shared_experts.gate_proj.weight", True, False),
    "shared_up": ("shared_experts.up_proj.weight", True, False),
    "shared_down": ("shared_experts.down_proj.weight", True, False),
}


def _source(path: tuple[str, ...], mc: ModelConfig, head: str = "lm_head") -> _Source | None:
  """The HF tensors of the leaf at `path` of nnx.state(Transformer); None for the head the
  architecture lacks (a causal LM's value head, a reward model's lm_head)."""
  top = {**_TOP, **_HEADS[head]}
  if path in top:
    return top[path]
  if path[0] in ("value_head", "lm_head"):
    return None
  stack, *rest = path
  if stack not in ("dense_stack", "moe_stack"):
    raise ValueError(f"no Hugging Face tensor is known for meshrl parameter {'/'.join(path)}.")
  first = 0 if stack == "dense_stack" else mc.num_dense_layers
  if stack == "moe_stack" and rest[0] == "mlp":
    name, transpose, per_expert = _MOE[rest[1]]
    return _Source("model.layers.{layer}.mlp." + name, transpose, first, per_expert)
  *modules, leaf = rest
  hf_modules = ".".join(_RENAMES.get(m, m) for m in modules)
  return _Source(f"model.layers.{{layer}}.{hf_modules}.weight", leaf == "kernel", first)


# --------------------------------------------------------------------------------------------------
# Import.


class _Reader:
  """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint, slice by slice."""

  def __init__(self, hf_dir: str, stack: contextlib.ExitStack):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
      weight_map = read_json(index)["weight_map"]
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
      weight_map = None
    else:
      raise ValueError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json.")
    try:
      import torch  # pylint: disable=import-outside-toplevel,unused-import
      self.framework = "pt"  # reads bf16, which numpy cannot
    except ImportError:
      self.framework = "numpy"
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    self.handles = {f: stack.enter_context(safe_open(os.path.join(hf_dir, f), self.framework))
                    for f in files}
    if weight_map is None:
      weight_map = {name: "model.safetensors" for name in self.handles["model.safetensors"].keys()}
    self.weight_map = weight_map

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The [start, stop) block `index` of tensor `name`, as numpy (bf16 as ml_dtypes.bfloat16)."""
    tensor = self.handles[self.weight_map[name]].get_slice(name)
    if self.framework == "numpy" and tensor.get_dtype() == "BF16":
      raise ValueError(f"{name} is bfloat16, which needs torch to read (pip install meshrl[hf]).")
    block = tensor[tuple(slice(*r) for r in index)]
    if self.framework == "numpy":
      return block
    import torch  # pylint: disable=import-outside-toplevel
    if block.dtype == torch.bfloat16:
      import ml_dtypes  # pylint: disable=import-outside-toplevel
      return block.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return block.numpy()


def _read_block(reader: _Reader, source: _Source, index: tuple[tuple[int, int], ...]) -> np.ndarray:
  """The block `index` ([start, stop) per dimension) of a meshrl leaf, read from its HF tensors."""
  def one(name, inner):
    block = reader.read(name, tuple(reversed(inner)) if source.transpose else inner)
    return block.T if source.transpose else block
  if source.first_layer is None:
    return one(source.template, index)
  layers = range(*index[0])
  if source.per_expert:
    experts = range(*index[1])
    return np.stack([np.stack([one(source.name(l, e), index[2:]) for e in experts]) for l in layers])
  return np.stack([one(source.name(l), index[1:]) for l in layers])


def _check_tensors(reader: _Reader, plan: dict, mc: ModelConfig, hf_dir: str):
  """Raises ValueError naming missing, misshapen and unknown tensors."""
  wanted = {name: source.hf_shape(shape) for source, shape in plan.values()
            for name in source.names(shape)}
  missing = sorted(set(wanted) - set(reader.weight_map))
  if missing:
    raise ValueError(f"{hf_dir} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:20])}"
                     + (" ..." if len(missing) > 20 else ""))
  wrong = [f"{n} {reader.shape(n)} (expected {s})" for n, s in wanted.items() if reader.shape(n) != s]
  if wrong:
    raise ValueError(f"{hf_dir} has tensors of the wrong shape: {', '.join(wrong[:20])}")

  def skipped(name):
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return ((layer and int(layer.group(1)) >= mc.num_layers) or name.endswith("rotary_emb.inv_freq")
            or (name == "lm_head.weight" and mc.tie_embeddings))
  unknown = sorted(n for n in set(reader.weight_map) - set(wanted) if not skipped(n))
  if unknown:
    raise ValueError(f"{hf_dir} has {len(unknown)} tensor(s) meshrl does not map and would drop: "
                     f"{', '.join(unknown[:20])}")


def _load_leaf(reader: _Reader, source: _Source | None, variable: nnx.Variable, sharding) -> jax.Array:
  """One leaf, built on its sharding; each distinct device block is read once."""
  shape, dtype = tuple(variable.shape), variable.dtype
  blocks = {}

  def block(index):
    key = tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))
    if key not in blocks:
      blocks[key] = (np.zeros(tuple(b - a for a, b in key), dtype) if source is None  # head HF lacks
                     else np.asarray(_read_block(reader, source, key), dtype=dtype))
    return blocks[key]
  return jax.make_array_from_callback(shape, sharding, block)


def import_checkpoint(hf_dir: str, mesh: Mesh | None = None,
                      cfg: ml_collections.ConfigDict | None = None, *, rules: Rules = TRAIN_RULES,
                      numbers: ModelConfig | None = None) -> tuple[Transformer, ml_collections.ConfigDict]:
  """Builds a Transformer from a Hugging Face checkpoint, each parameter read into its sharding.

  Args:
    hf_dir: directory with config.json and model.safetensors (or model.safetensors.index.json).
    mesh: the run's mesh (None: one device).
    cfg: the run config; its model.* / moe.* fields must match the checkpoint
      (`load_hf_config(hf_dir, base=cfg)` makes them). Default: `load_hf_config(hf_dir)`.
    rules: logical axis rules for the parameter shardings.
    numbers: cfg's model numbers on `mesh` when the caller built them (train/init_from.py); default
      built here from cfg (the folder's own config without one).

  Returns:
    (model, cfg). Parameters are stored in model.param_dtype; a value head (model.value_head) starts
    at zero, except from a sequence classifier, whose `score` it is.
  """
  if cfg is None:
    cfg = load_hf_config(hf_dir)
  else:
    check_config_matches(cfg, hf_dir)
  mc = ModelConfig.from_config(cfg, mesh) if numbers is None else numbers
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))))
  flat = list(nnx.to_flat_state(abstract))
  if mesh is None:
    shardings = [SingleDeviceSharding(jax.devices()[0])] * len(flat)
  else:
    shardings = [s for _, s in nnx.to_flat_state(state_shardings(abstract, mesh, rules))]
  head = architecture_of(hf_architecture(read_json(os.path.join(hf_dir, "config.json")))).head
  plan = {path: (_source(path, mc, head), tuple(v.shape)) for path, v in flat}
  with contextlib.ExitStack() as stack:
    reader = _Reader(hf_dir, stack)
    _check_tensors(reader, {p: s for p, s in plan.items() if s[0] is not None}, mc, hf_dir)
    loaded = [(path, v.replace(_load_leaf(reader, plan[path][0], v, sharding)))
              for (path, v), sharding in zip(flat, shardings)]
  return nnx.merge(graphdef, nnx.from_flat_state(loaded)), cfg


# --------------------------------------------------------------------------------------------------
# Export.


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor to write: block [layer][expert] of leaf `path` (zeros when path is None)."""
  name: str
  path: tuple[str, ...] | None
  layer: int | None
  expert: int | None
  transpose: bool
  shape: tuple[int, ...]
  dtype: Any


def _export_entries(leaves: dict, mc: ModelConfig, architecture: str, dtype) -> list[_Entry]:
  """The HF tensors in file order (embedding, layer by layer, final norm and head)."""
  top, per_layer = {}, [[] for _ in range(mc.num_layers)]
  for path, variable in sorted(leaves.items()):
    source = _source(path, mc, architecture_of(architecture).head)
    if source is None:
      _LOG.warning("export: %s has no Hugging Face counterpart; not written.", "/".join(path))
      continue
    shape = tuple(variable.shape)
    leaf_dtype = np.float32 if path[-1] == "router_bias" else dtype  # HF keeps the bias in float32
    if source.first_layer is None:
      top[path] = _Entry(source.template, path, None, None, source.transpose, source.hf_shape(shape),
                         leaf_dtype)
      continue
    for l in range(shape[0]):
      per_layer[source.first_layer + l] += [
          _Entry(source.name(l, e), path, l, e, source.transpose, source.hf_shape(shape), leaf_dtype)
          for e in (range(shape[1]) if source.per_expert else [None])]
  if architecture == "DeepseekV3ForCausalLM" and ("moe_stack", "mlp", "router_bias") not in leaves:
    for l in range(mc.num_dense_layers, mc.num_layers):  # HF always has the bias: write zeros
      per_layer[l].append(_Entry(f"model.layers.{l}.mlp.gate.e_score_correction_bias", None, None,
                                 None, False, (mc.num_experts,), np.float32))
  embed = [top.pop(("embed", "embedding"))] if ("embed", "embedding") in top else []
  return embed + [entry for layer in per_layer for entry in layer] + list(top.values())


def _shard(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
  """Consecutive groups of entries of at most max_bytes each (an oversized tensor stands alone)."""
  shards, size = [[]], 0
  for entry in entries:
    nbytes = math.prod(entry.shape) * np.dtype(entry.dtype).itemsize
    if shards[-1] and size + nbytes > max_bytes:
      shards, size = shards + [[]], 0
    shards[-1].append(entry)
    size += nbytes
  return shards


EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # can hold the weights as they are


def check_export_dtype(dtype: str | None, field: str = "dtype") -> None:
  """ValueError unless `dtype` (None = the parameters' own) is a float type that holds the weights:
  an integer type without scales rounds weights of magnitude ~0.02 to 0 (int8 wrote 99.7% zeros)."""
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(f"{field}={dtype!r} cannot hold the weights (an integer type without scales rounds "
                     f"them to zero); choose one of {', '.join(EXPORT_DTYPES)}.")


def export_checkpoint(model_or_state: nnx.Module | nnx.State, cfg: ml_collections.ConfigDict,
                      out_dir: str, architecture: str, *, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 2**30, pad_token_id: int | None = None) -> list[str]:
  """Writes a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained(out_dir)` loads
  (`AutoModelForSequenceClassification` for a reward model).

  Args:
    model_or_state: a Transformer or its nnx.state (sharded arrays are gathered one layer of one
      parameter at a time; every array must be addressable from this process).
    cfg: the run config the model was built from.
    out_dir: created if needed; gets config.json and model.safetensors, or numbered shards of at most
      `max_shard_bytes` plus model.safetensors.index.json.
    architecture: "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM" or, for a reward model (the value
      head is the score), "Qwen3MoeForSequenceClassification".
    dtype: storage dtype of the written tensors ("bfloat16", "float32", ...); default: the parameters'.
    pad_token_id: written into config.json when given (the tokenizer's pad id): a sequence classifier
      reads each row's score at its last token that is not this id, and without one transformers
      scores only batches of one row.

  Returns:
    The paths of the files written. Raises ValueError when the architecture cannot express the config
    (e.g. Qwen3-MoE without qk_norm).
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  mc = ModelConfig.from_config(cfg)
  hf_config = architecture_of(architecture).write(mc)
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  leaves = dict(nnx.to_flat_state(state))
  expected = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0)))))
  wrong = [f"{'/'.join(path)} {tuple(v.shape)} is {tuple(leaves[path].shape) if path in leaves else 'absent'}"
           for path, v in expected if path not in leaves or leaves[path].shape != v.shape]
  if wrong:
    raise ValueError(f"the state does not fit cfg (pass the whole nnx.state(model)): {', '.join(wrong[:20])}")
  check_export_dtype(dtype)
  out_dtype = jnp.dtype(dtype or leaves[("embed", "embedding")].dtype)
  hf_config.update(architectures=[architecture], dtype=out_dtype.name, torch_dtype=out_dtype.name)
  if pad_token_id is not None:
    hf_config["pad_token_id"] = int(pad_token_id)
  shards = _shard(_export_entries(leaves, mc, architecture, out_dtype), max_shard_bytes)

  gathered = {}  # holds one (leaf, layer) block at a time

  def tensor(entry: _Entry) -> np.ndarray:
    if entry.path is None:
      return np.zeros(entry.shape, entry.dtype)
    key = (entry.path, entry.layer)
    if key not in gathered:
      gathered.clear()
      value = leaves[entry.path].get_value()
      gathered[key] = np.asarray(jax.device_get(value if entry.layer is None else value[entry.layer]))
    value = gathered[key] if entry.expert is None else gathered[key][entry.expert]
    return np.ascontiguousarray((value.T if entry.transpose else value).astype(entry.dtype))

  os.makedirs(out_dir, exist_ok=True)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  written, weight_map, total = [], {}, 0
  for file_name, shard in zip(names, shards):
    tensors = {entry.name: tensor(entry) for entry in shard}
    save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
    written.append(os.path.join(out_dir, file_name))
    weight_map.update(dict.fromkeys(tensors, file_name))
    total += sum(t.nbytes for t in tensors.values())
  if len(shards) > 1:
    written.append(os.path.join(out_dir, "model.safetensors.index.json"))
    with open(written[-1], "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  written.append(os.path.join(out_dir, "config.json"))
  with open(written[-1], "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  return written
