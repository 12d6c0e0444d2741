"""The ranges of a model's numbers, checked before anything is built: each error names its config field.

  check_sizes(mc)               widths, counts and coefficients of a ModelConfig (its __post_init__)
  check_config_values(m, att)   the model / attention config sections ModelConfig.from_config reads
"""

from __future__ import annotations

from meshrl.model import moe as moe_lib

FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # model.dtype / model.param_dtype
ATTENTION_IMPLS = ("reference", "blockwise", "ring")  # attention.impl


def _at_least(name: str, value, low) -> None:
  if not value >= low:
    raise ValueError(f"{name}={value} must be at least {low}.")


def check_sizes(mc) -> None:
  """Every width, count and coefficient of a model in its range, named by its config field."""
  for name in ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "max_seq_len"):
    _at_least(f"model.{name}", getattr(mc, name), 1)
  if mc.attention_type == "mla":
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
      _at_least(f"model.{name}", getattr(mc, name), 1)
    for name in ("q_lora_rank", "qk_nope_head_dim"):
      _at_least(f"model.{name}", getattr(mc, name), 0)
  else:
    _at_least("model.head_dim", mc.head_dim, 1)
  _at_least("model.mlp_dim", mc.mlp_dim, 1 if mc.num_dense_layers else 0)
  if not (mc.norm_eps > 0 and mc.init_std > 0):
    raise ValueError(f"model.norm_eps={mc.norm_eps} and model.init_std={mc.init_std} must be positive.")
  _at_least("moe.num_experts", mc.num_experts, 0)
  if not mc.num_experts:
    return
  _at_least("moe.num_experts_per_tok", mc.num_experts_per_tok, 1)
  _at_least("moe.expert_mlp_dim", mc.expert_mlp_dim, 1)
  _at_least("moe.num_shared_experts", mc.num_shared_experts, 0)
  if mc.num_shared_experts:
    _at_least("moe.shared_expert_mlp_dim", mc.shared_expert_mlp_dim, 1)
  _at_least("moe.n_group", mc.n_group, 1)
  if mc.num_experts % mc.n_group or not 1 <= mc.topk_group <= mc.n_group:
    raise ValueError(f"moe.n_group={mc.n_group} must divide moe.num_experts={mc.num_experts} and "
                     f"moe.topk_group={mc.topk_group} lie in [1, moe.n_group].")
  if not (mc.routed_scaling_factor > 0 and mc.capacity_factor > 0):
    raise ValueError(f"moe.routed_scaling_factor={mc.routed_scaling_factor} and moe.capacity_factor="
                     f"{mc.capacity_factor} must be positive.")
  if mc.score_func not in moe_lib.SCORE_FUNCS:
    raise ValueError(f"moe.score_func={mc.score_func!r} is not one of {', '.join(moe_lib.SCORE_FUNCS)}.")


def check_config_values(m, att) -> None:
  """The model.* / attention.* fields ModelConfig.from_config reads before building its parts (dtypes, RoPE,
  kernel blocks), named by field (the parts' own errors would name their arguments)."""
  for name in ("dtype", "param_dtype"):
    if m[name] not in FLOAT_DTYPES:
      raise ValueError(f"model.{name}={m[name]!r} is not one of {', '.join(FLOAT_DTYPES)}.")
  if att.impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention.impl={att.impl!r} is not one of {', '.join(ATTENTION_IMPLS)}.")
  for name in ("block_q", "block_kv"):
    _at_least(f"attention.{name}", att[name], 1)
  _at_least("attention.logits_chunk", att.get("logits_chunk", 0), 0)
  if m.rope_scaling not in ("none", "linear", "yarn"):
    raise ValueError(f"model.rope_scaling={m.rope_scaling!r} is not one of 'none', 'linear', 'yarn'.")
  if not m.rope_theta > 0:
    raise ValueError(f"model.rope_theta={m.rope_theta} must be positive.")
  rope_dim = ("model.qk_rope_head_dim", m.qk_rope_head_dim) if m.attention_type == "mla" else (
      "model.head_dim", m.head_dim)
  if rope_dim[1] % 2:
    raise ValueError(f"{rope_dim[0]}={rope_dim[1]} must be even (RoPE rotates pairs of features).")
  if m.rope_scaling != "none":
    _at_least("model.rope_factor", m.rope_factor, 1.0)
    _at_least("model.rope_original_max_len", m.rope_original_max_len, 1)
    if not (m.rope_beta_fast > 0 and m.rope_beta_slow > 0 and m.rope_mscale > 0 and m.rope_mscale_all_dim >= 0):
      raise ValueError(f"model.rope_beta_fast={m.rope_beta_fast}, model.rope_beta_slow={m.rope_beta_slow} "
                       f"and model.rope_mscale={m.rope_mscale} must be positive, model.rope_mscale_all_dim="
                       f"{m.rope_mscale_all_dim} >= 0.")
