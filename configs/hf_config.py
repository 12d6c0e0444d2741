"""Hugging Face config.json <-> meshrl's model.* / moe.* fields, per supported architecture
(Qwen3-MoE causal LM and reward model, DeepSeek-V3): what a checkpoint's config decides and the
config.json an export writes; model/convert.py moves the weights. It lives in configs/ because a
preset (configs/hf_qwen3_moe.py) reads a folder through it, and presets import nothing but configs
(no jax either: the write direction's ModelConfig is a type annotation only).

  cfg = load_hf_config(hf_dir)          # configs/base.py with the checkpoint's architecture fields
  hf_fields(hf_dir)                     # {"model.vocab_size": 151936, ...}
  ARCHITECTURES[name].write(mc)         # model numbers -> config.json (raises if inexpressible)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any, Callable

import ml_collections

from meshrl.configs import load_preset

if TYPE_CHECKING:  # the write direction reads model numbers; configs/ imports no model code at run time
  from meshrl.model.transformer import ModelConfig


def read_json(path: str) -> dict:
  if not os.path.exists(path):
    raise ValueError(f"{path} does not exist; expected a Hugging Face checkpoint directory.")
  with open(path) as f:
    return json.load(f)


def _rope_fields(hf: dict) -> dict[str, Any]:
  """model.rope_* from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  kind = params.get("rope_type", params.get("type", "default"))
  fields = {"model.rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
  if kind == "default":
    return {**fields, "model.rope_scaling": "none"}
  if kind == "linear":
    return {**fields, "model.rope_scaling": "linear", "model.rope_factor": float(params["factor"])}
  if kind != "yarn":
    raise ValueError(f"rope type {kind!r} is not supported; supported: default, linear, yarn.")
  max_len = hf["max_position_embeddings"]
  original = params.get("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings", max_len))
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  if params.get("attention_factor") is not None or params.get("truncate", True) is False:
    raise ValueError(f"YaRN with attention_factor={params.get('attention_factor')} or "
                     f"truncate={params.get('truncate')} is not supported.")
  if mscale_all_dim and not mscale:
    raise ValueError(f"YaRN with mscale_all_dim={mscale_all_dim} and mscale={mscale} is not supported.")
  return {**fields, "model.rope_scaling": "yarn",
          "model.rope_factor": float(params.get("factor") or max_len / original),
          "model.rope_original_max_len": int(original),
          "model.rope_beta_fast": float(params.get("beta_fast") or 32.0),
          "model.rope_beta_slow": float(params.get("beta_slow") or 1.0),
          "model.rope_mscale": float(mscale or 1.0),
          "model.rope_mscale_all_dim": float(mscale_all_dim or 0.0)}


def _common_fields(hf: dict) -> dict[str, Any]:
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; meshrl's MLPs are SwiGLU (silu).")
  if hf.get("attention_bias"):
    raise ValueError("attention_bias=True is not supported; meshrl's projections have no bias.")
  if hf.get("quantization_config"):
    raise ValueError(f"quantized checkpoints ({hf['quantization_config'].get('quant_method')}) are not "
                     "supported; dequantize the weights to bf16/fp32 first.")
  return {"model.vocab_size": int(hf["vocab_size"]), "model.num_layers": int(hf["num_hidden_layers"]),
          "model.embed_dim": int(hf["hidden_size"]), "model.num_heads": int(hf["num_attention_heads"]),
          "model.mlp_dim": int(hf["intermediate_size"]),
          "model.max_seq_len": int(hf["max_position_embeddings"]),
          "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
          "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
          "moe.expert_mlp_dim": int(hf["moe_intermediate_size"]),
          "moe.num_experts_per_tok": int(hf["num_experts_per_tok"]),
          "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", False)), **_rope_fields(hf)}


def _qwen3_moe_fields(hf: dict) -> dict[str, Any]:
  if hf.get("use_sliding_window"):
    raise ValueError("use_sliding_window=True is not supported (meshrl attention is full causal).")
  num_layers = hf["num_hidden_layers"]
  num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))
  step, mlp_only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
  dense = [i for i in range(num_layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)]
  if num_experts and dense != list(range(len(dense))):
    raise ValueError(f"decoder_sparse_step={step} and mlp_only_layers={mlp_only} make layers {dense} "
                     f"dense; meshrl needs the dense layers to be the first ones (0..k-1).")
  heads = hf["num_attention_heads"]
  return {**_common_fields(hf), "model.attention_type": "gqa", "model.qk_norm": True,
          "model.num_kv_heads": int(hf["num_key_value_heads"]),
          "model.head_dim": int(hf.get("head_dim") or hf["hidden_size"] // heads),
          "model.rope_interleave": False, "moe.num_experts": num_experts,
          "moe.first_k_dense": len(dense) if num_experts else 0, "moe.num_shared_experts": 0,
          "moe.score_func": "softmax", "moe.routed_scaling_factor": 1.0, "moe.n_group": 1,
          "moe.topk_group": 1, "moe.aux_free_bias": False}


def _deepseek_v3_fields(hf: dict) -> dict[str, Any]:
  if hf.get("rms_norm_eps", 1e-6) != 1e-6:
    _LOG.warning("DeepSeek-V3 hard-codes eps=1e-6 in q_a_layernorm/kv_a_layernorm; meshrl uses "
                 "rms_norm_eps=%s there too, so outputs differ slightly.", hf["rms_norm_eps"])
  num_layers = hf["num_hidden_layers"]
  nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
  return {**_common_fields(hf), "model.attention_type": "mla", "model.qk_norm": False,
          "model.num_kv_heads": int(hf["num_attention_heads"]), "model.head_dim": nope + rope,
          "model.q_lora_rank": int(hf.get("q_lora_rank") or 0),
          "model.kv_lora_rank": int(hf["kv_lora_rank"]), "model.qk_nope_head_dim": nope,
          "model.qk_rope_head_dim": rope, "model.v_head_dim": int(hf["v_head_dim"]),
          "model.rope_interleave": bool(hf.get("rope_interleave", True)),
          "moe.num_experts": int(hf["n_routed_experts"]),
          "moe.first_k_dense": min(int(hf.get("first_k_dense_replace") or 0), num_layers),
          "moe.num_shared_experts": int(hf.get("n_shared_experts") or 0),
          "moe.shared_expert_mlp_dim": int(hf["moe_intermediate_size"]),
          "moe.score_func": "sigmoid",
          "moe.routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
          "moe.n_group": int(hf.get("n_group") or 1), "moe.topk_group": int(hf.get("topk_group") or 1),
          "moe.aux_free_bias": True}


def _rope_hf(mc: ModelConfig) -> dict | None:
  rope = mc.rope
  if rope.scaling == "none":
    return None
  if rope.scaling == "linear":
    return {"rope_type": "linear", "factor": rope.factor}
  if rope.mscale_all_dim and not rope.mscale:
    raise ValueError(f"rope_mscale=0 with rope_mscale_all_dim={rope.mscale_all_dim} has no HF form.")
  out = {"rope_type": "yarn", "factor": rope.factor, "original_max_position_embeddings":
         rope.original_max_len, "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
         "mscale": rope.mscale}
  return {**out, "mscale_all_dim": rope.mscale_all_dim} if rope.mscale_all_dim else out


def _common_hf(mc: ModelConfig) -> dict:
  rope = _rope_hf(mc)
  return {"vocab_size": mc.vocab_size, "hidden_size": mc.embed_dim, "intermediate_size": mc.mlp_dim,
          "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_heads,
          "hidden_act": "silu", "max_position_embeddings": mc.max_seq_len, "rms_norm_eps": mc.norm_eps,
          "tie_word_embeddings": mc.tie_embeddings, "attention_bias": False,
          "moe_intermediate_size": mc.expert_mlp_dim, "num_experts_per_tok": mc.num_experts_per_tok,
          "norm_topk_prob": mc.norm_topk_prob,
          # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
          "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope.theta, **(rope or {})},
          "rope_theta": mc.rope.theta, "rope_scaling": rope and {**rope, "type": rope["rope_type"]}}


def _qwen3_moe_hf(mc: ModelConfig, name: str = "Qwen3MoeForCausalLM") -> dict:
  problems = [f"{name}={value!r} (needs {want!r})" for name, value, want in (
      ("model.attention_type", mc.attention_type, "gqa"), ("model.qk_norm", mc.qk_norm, True),
      ("model.rope_interleave", mc.rope.interleave, False), ("moe.score_func", mc.score_func, "softmax"),
      ("moe.num_shared_experts", mc.num_shared_experts, 0), ("moe.n_group", mc.n_group, 1),
      ("moe.routed_scaling_factor", mc.routed_scaling_factor, 1.0),
      ("moe.aux_free_bias", mc.aux_free_bias, False)) if value != want]
  if problems:
    raise ValueError(f"{name} cannot represent {', '.join(problems)}.")
  return {**_common_hf(mc), "model_type": "qwen3_moe", "num_key_value_heads": mc.num_kv_heads,
          "head_dim": mc.head_dim, "num_experts": mc.num_experts, "decoder_sparse_step": 1,
          "mlp_only_layers": list(range(mc.num_dense_layers)), "use_sliding_window": False}


def _num_labels(hf: dict) -> int:
  """Labels of a sequence-classification config: its id2label's, else num_labels (default 2, as
  transformers' PretrainedConfig)."""
  labels = hf.get("id2label")
  return len(labels) if labels else int(hf.get("num_labels") or 2)


def _qwen3_moe_rm_fields(hf: dict) -> dict[str, Any]:
  if _num_labels(hf) != 1:
    raise ValueError(f"Qwen3MoeForSequenceClassification with num_labels={_num_labels(hf)}: a reward model "
                     "has one score (num_labels=1).")
  return {**_qwen3_moe_fields(hf), "model.tie_embeddings": True, "model.value_head": True}


def _qwen3_moe_rm_hf(mc: ModelConfig) -> dict:
  if not mc.value_head:
    raise ValueError("Qwen3MoeForSequenceClassification cannot represent model.value_head=False "
                     "(needs True: the value head is its score).")
  return {**_qwen3_moe_hf(mc, "Qwen3MoeForSequenceClassification"), "tie_word_embeddings": False,
          "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def _deepseek_v3_hf(mc: ModelConfig) -> dict:
  problems = [f"{name}={value!r} (needs {want!r})" for name, value, want in (
      ("model.attention_type", mc.attention_type, "mla"), ("moe.score_func", mc.score_func, "sigmoid"),
      ("moe.shared_expert_mlp_dim", mc.shared_expert_mlp_dim or mc.expert_mlp_dim, mc.expert_mlp_dim))
      if value != want]
  if not mc.num_experts:
    problems.append("moe.num_experts=0 (needs experts)")
  if problems:
    raise ValueError(f"DeepseekV3ForCausalLM cannot represent {', '.join(problems)}.")
  return {**_common_hf(mc), "model_type": "deepseek_v3", "num_key_value_heads": mc.num_heads,
          "n_routed_experts": mc.num_experts, "n_shared_experts": mc.num_shared_experts,
          "routed_scaling_factor": mc.routed_scaling_factor, "kv_lora_rank": mc.kv_lora_rank,
          "q_lora_rank": mc.q_lora_rank or None, "qk_nope_head_dim": mc.qk_nope_head_dim,
          "qk_rope_head_dim": mc.qk_rope_head_dim, "v_head_dim": mc.v_head_dim,
          "n_group": mc.n_group, "topk_group": mc.topk_group, "first_k_dense_replace": mc.first_k_dense,
          "rope_interleave": mc.rope.interleave, "num_nextn_predict_layers": 0}


@dataclasses.dataclass(frozen=True)
class _Architecture:
  model_type: str
  read: Callable[[dict], dict[str, Any]]  # HF config.json -> {"model.x": value}
  write: Callable[[ModelConfig], dict]  # model numbers -> HF config.json (raises if inexpressible)
  head: str = "lm_head"  # the output head HF stores: "lm_head" (causal LM) or "score" (a reward model)


ARCHITECTURES = {
    "Qwen3MoeForCausalLM": _Architecture("qwen3_moe", _qwen3_moe_fields, _qwen3_moe_hf),
    "DeepseekV3ForCausalLM": _Architecture("deepseek_v3", _deepseek_v3_fields, _deepseek_v3_hf),
    "Qwen3MoeForSequenceClassification": _Architecture("qwen3_moe", _qwen3_moe_rm_fields, _qwen3_moe_rm_hf,
                                                       head="score"),
}


def architecture_of(name: str) -> _Architecture:
  if name not in ARCHITECTURES:
    raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}.")
  return ARCHITECTURES[name]


def hf_architecture(hf: dict) -> str:
  names = hf.get("architectures") or [n for n, a in ARCHITECTURES.items()
                                      if a.model_type == hf.get("model_type")] or [hf.get("model_type")]
  return names[0]


def hf_fields(hf_dir: str) -> dict[str, Any]:
  """{"model.vocab_size": 151936, ...}: the meshrl fields the checkpoint's config.json decides."""
  hf = read_json(os.path.join(hf_dir, "config.json"))
  return architecture_of(hf_architecture(hf)).read(hf)


def load_hf_config(hf_dir: str, base: ml_collections.ConfigDict | None = None
                   ) -> ml_collections.ConfigDict:
  """The run config for a Hugging Face checkpoint: `base` (default: configs/base.py) with every
  architecture field (model.*, moe.*) taken from `hf_dir/config.json`; returned locked.

  Raises ValueError for an unsupported architecture (naming it and the supported ones) or a feature
  meshrl lacks (sliding window, attention bias, non-prefix dense layers, quantized weights, ...).
  """
  fields = hf_fields(hf_dir)
  config = ml_collections.ConfigDict((base if base is not None else load_preset("base")).to_dict())
  if base is None:
    config.name = "hf_" + os.path.basename(os.path.normpath(hf_dir))
  for key, value in fields.items():
    section, name = key.split(".")
    config[section][name] = value
  config.lock()
  return config


def check_config_matches(cfg: ml_collections.ConfigDict, hf_dir: str):
  def get(key):
    section, name = key.split(".")
    return cfg[section][name]
  wrong = [f"{key}={get(key)!r} (checkpoint: {value!r})" for key, value in hf_fields(hf_dir).items()
           if get(key) != value]
  if wrong:
    raise ValueError(f"config does not match {hf_dir}/config.json: {', '.join(wrong)}; build it with "
                     "load_hf_config(hf_dir, base=cfg).")
