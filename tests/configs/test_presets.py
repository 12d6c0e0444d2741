"""The published-architecture presets (qwen3_moe_30b, deepseek_v3) and the 3T preset: their numbers
are the published ones (read through model/convert.py as an import would), and their parameter
counts, from shapes alone (jax.eval_shape), are the published counts."""

import json

import pytest

from meshrl import configs
from meshrl.model import convert
from meshrl.model.init import parameter_counts
from meshrl.model.transformer import ModelConfig

# The architecture keys of the published config.json files (huggingface.co/<repo>/blob/main/config.json).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "router_aux_loss_coef": 0.001}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "num_nextn_predict_layers": 1}


@pytest.mark.parametrize("preset, published", [("qwen3_moe_30b", QWEN3_30B_A3B),
                                               ("deepseek_v3", DEEPSEEK_V3)])
def test_preset_has_the_published_architecture(tmp_path, preset, published):
  """Every model.* / moe.* field the importer reads from the published config.json equals the preset's
  (a mistyped width, a flipped rope_interleave or a missing shared expert fails here)."""
  (tmp_path / "config.json").write_text(json.dumps(published))
  config = configs.load(f"configs/{preset}.py")
  fields = convert.hf_fields(str(tmp_path))
  wrong = {key: (config[key.split(".")[0]][key.split(".")[1]], value) for key, value in fields.items()
           if config[key.split(".")[0]][key.split(".")[1]] != value}
  assert not wrong, f"preset vs published: {wrong}"


@pytest.mark.parametrize("preset, total, active, tolerance", [
    ("qwen3_moe_30b", 30.5e9, 3.3e9, 0.02),  # "30.5B in total and 3.3B activated" (model card)
    ("deepseek_v3", 671e9, 37e9, 0.02),  # 671B total, 37B activated, without the 14B MTP module
    ("paper_3t", 3.0e12, 39.7e9, 0.01),  # ours: about 3.0T total
])
def test_parameter_counts_from_shapes(preset, total, active, tolerance):
  counts = parameter_counts(ModelConfig.from_config(configs.load(f"configs/{preset}.py")))
  assert counts["total"] == pytest.approx(total, rel=tolerance)
  assert counts["active_per_token"] == pytest.approx(active, rel=tolerance)


def test_paper_3t_is_a_1m_context_ring_attention_model():
  config = configs.load("configs/paper_3t.py")
  assert config.attention.impl == "ring"
  assert config.rl.max_prompt_len + config.rl.max_new_tokens == config.model.max_seq_len == 2 ** 20
  sizes = [config.mesh[a] for a in ("data", "fsdp", "expert", "sequence", "tensor")]
  assert -1 not in sizes and sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] == 16 ** 3
