"""Hugging Face conversion: imported models give HF's logits, export round-trips exactly, bad input."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshrl import configs  # noqa: E402
from meshrl.model import convert  # noqa: E402
from meshrl.model.init import parameter_counts  # noqa: E402
from meshrl.model.transformer import ModelConfig  # noqa: E402
from meshrl.sharding import make_mesh  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
              initializer_range=0.2)  # large weights: routing scores far from ties
HF_CONFIGS = {
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=2.0,
                             original_max_position_embeddings=32)),
    "DeepseekV3ForCausalLM": lambda: transformers.DeepseekV3Config(
        **COMMON, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0,
                             original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=0.7)),
}
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (4, 16))


def _hf_logits(hf_model):
  with torch.no_grad():
    return hf_model(torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
  """(architecture, HF checkpoint dir, HF fp32 logits on TOKENS) for a tiny random HF model."""
  architecture = request.param
  torch.manual_seed(0)
  hf_model = transformers.AutoModelForCausalLM.from_config(
      HF_CONFIGS[architecture](), attn_implementation="eager").float().eval()
  if architecture == "DeepseekV3ForCausalLM":
    for layer in hf_model.model.layers[1:]:  # a nonzero selection bias, so its path is exercised
      layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
  hf_dir = str(tmp_path_factory.mktemp(architecture))
  hf_model.save_pretrained(hf_dir)
  return architecture, hf_dir, _hf_logits(hf_model)


def _logits(model):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, TOKENS))


def test_load_hf_config(tmp_path):
  tmp = str(tmp_path)
  HF_CONFIGS["DeepseekV3ForCausalLM"]().save_pretrained(tmp)
  cfg = convert.load_hf_config(tmp)
  assert (cfg.model.attention_type, cfg.model.q_lora_rank, cfg.model.v_head_dim) == ("mla", 24, 12)
  assert (cfg.moe.num_experts, cfg.moe.first_k_dense, cfg.moe.n_group, cfg.moe.topk_group) == (8, 1, 4, 2)
  assert (cfg.moe.num_shared_experts, cfg.moe.shared_expert_mlp_dim, cfg.moe.score_func) == (1, 32, "sigmoid")
  assert cfg.moe.aux_free_bias and cfg.model.rope_interleave and cfg.moe.routed_scaling_factor == 2.5
  assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_mscale_all_dim) == ("yarn", 4.0, 0.7)
  with pytest.raises(AttributeError):
    cfg.model.not_a_field = 1  # locked
  HF_CONFIGS["Qwen3MoeForCausalLM"]().save_pretrained(tmp)
  cfg = convert.load_hf_config(tmp, base=configs.load_preset("tiny"))
  assert cfg.name == "tiny" and cfg.model.qk_norm and cfg.moe.first_k_dense == 1
  assert (cfg.model.num_kv_heads, cfg.model.head_dim, cfg.model.rope_theta) == (2, 16, 1000.0)


def test_import_matches_hf_logits(checkpoint):
  architecture, hf_dir, hf_logits = checkpoint
  model, _ = convert.import_checkpoint(hf_dir)
  logits = _logits(model)
  diff = np.abs(logits - hf_logits).max()
  print(f"{architecture}: max |meshrl - HF| = {diff:.2e}")
  assert diff <= 1e-4
  if architecture == "DeepseekV3ForCausalLM":  # the selection bias changes which experts run
    model.moe_stack.mlp.router_bias[...] = np.zeros_like(model.moe_stack.mlp.router_bias[...])
    assert np.abs(_logits(model) - hf_logits).max() > 1e-3


def test_export_round_trip(checkpoint, tmp_path):
  architecture, hf_dir, hf_logits = checkpoint
  model, cfg = convert.import_checkpoint(hf_dir)
  written = convert.export_checkpoint(model, cfg, str(tmp_path), architecture, max_shard_bytes=2**16)
  assert any(p.endswith("model.safetensors.index.json") for p in written)  # several shards
  again, _ = convert.import_checkpoint(str(tmp_path), cfg=cfg)
  before, after = dict(nnx.to_flat_state(nnx.state(model))), dict(nnx.to_flat_state(nnx.state(again)))
  assert before.keys() == after.keys()
  for path in before:
    np.testing.assert_array_equal(np.asarray(after[path][...]), np.asarray(before[path][...]),
                                  err_msg="/".join(path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
  np.testing.assert_array_equal(_hf_logits(reloaded), hf_logits)


def test_sharded_import_matches(checkpoint, devices):
  del devices
  architecture, hf_dir, hf_logits = checkpoint
  cfg = convert.load_hf_config(hf_dir)
  with cfg.unlocked():
    cfg.mesh.update(fsdp=2, expert=2, tensor=2)
  mesh = make_mesh(cfg.mesh)
  model, _ = convert.import_checkpoint(hf_dir, mesh, cfg)
  experts = model.moe_stack.mlp.gate[...]
  assert experts.sharding.spec[1] == "expert" and len(experts.addressable_shards) == 8
  diff = np.abs(_logits(model) - hf_logits).max()
  print(f"{architecture} on mesh fsdp=2 expert=2 tensor=2: max |meshrl - HF| = {diff:.2e}")
  assert diff <= 1e-4


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
  with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3MoeForCausalLM.*DeepseekV3ForCausalLM"):
    convert.load_hf_config(str(tmp_path))
  with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
    convert.export_checkpoint(None, configs.load_preset("tiny"), str(tmp_path), "GPT2LMHeadModel")


def test_qwen3_dense_layers_must_lead(tmp_path):
  config = HF_CONFIGS["Qwen3MoeForCausalLM"]()
  config.mlp_only_layers = [1]
  config.save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\] make layers \[1\] dense"):
    convert.load_hf_config(str(tmp_path))


@pytest.mark.parametrize("checkpoint", ["Qwen3MoeForCausalLM"], indirect=True)
def test_missing_unknown_and_mismatched(checkpoint, tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  _, hf_dir, _ = checkpoint
  shutil.copy(os.path.join(hf_dir, "config.json"), tmp_path)
  tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
  missing = "model.layers.2.mlp.experts.3.up_proj.weight"
  save_file({k: v for k, v in tensors.items() if k != missing}, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=f"lacks 1 tensor.*{missing}"):
    convert.import_checkpoint(str(tmp_path))
  save_file({**tensors, "model.layers.0.mlp.extra.weight": tensors["model.norm.weight"]},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="would drop: model.layers.0.mlp.extra.weight"):
    convert.import_checkpoint(str(tmp_path))
  cfg = convert.load_hf_config(hf_dir)
  with cfg.unlocked():
    cfg.model.num_layers = 2
  with pytest.raises(ValueError, match=r"model.num_layers=2 \(checkpoint: 3\)"):
    convert.import_checkpoint(hf_dir, cfg=cfg)


@pytest.mark.parametrize("checkpoint", ["DeepseekV3ForCausalLM"], indirect=True)
def test_bfloat16_export_and_import(checkpoint, tmp_path):
  architecture, hf_dir, _ = checkpoint
  model, cfg = convert.import_checkpoint(hf_dir)
  convert.export_checkpoint(model, cfg, str(tmp_path), architecture, dtype="bfloat16")
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  again, _ = convert.import_checkpoint(str(tmp_path), cfg=cfg)  # bf16 files into float32 params
  before, after = dict(nnx.to_flat_state(nnx.state(model))), dict(nnx.to_flat_state(nnx.state(again)))
  for path, variable in before.items():
    want = np.asarray(variable[...])
    if path[-1] != "router_bias":  # kept in float32, as HF does
      want = want.astype(jax.numpy.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(after[path][...]), want, err_msg="/".join(path))


PUBLISHED = {  # the architecture fields of the released config.json files
    "DeepSeek-V3": (dict(
        architectures=["DeepseekV3ForCausalLM"], first_k_dense_replace=3, hidden_size=7168,
        intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840,
        moe_intermediate_size=2048, n_group=8, n_routed_experts=256, n_shared_experts=1,
        norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61,
        num_key_value_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        rope_theta=10000, routed_scaling_factor=2.5, topk_group=4, v_head_dim=128, vocab_size=129280),
        671, 37),
    "Qwen3-30B-A3B": (dict(
        architectures=["Qwen3MoeForCausalLM"], head_dim=128, hidden_size=2048, intermediate_size=6144,
        max_position_embeddings=40960, moe_intermediate_size=768, norm_topk_prob=True,
        num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_key_value_heads=4, rope_scaling=None, rope_theta=1e6, vocab_size=151936), 30.5, 3.3),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_give_published_sizes(name, tmp_path):
  hf_config, total_b, active_b = PUBLISHED[name]
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  counts = parameter_counts(ModelConfig.from_config(convert.load_hf_config(str(tmp_path))))
  assert counts["total"] / 1e9 == pytest.approx(total_b, rel=0.02)  # the model cards' figures
  assert counts["active_per_token"] / 1e9 == pytest.approx(active_b, rel=0.02)


@pytest.mark.parametrize("checkpoint", ["DeepseekV3ForCausalLM"], indirect=True)
def test_export_rejects_what_hf_cannot_hold(checkpoint, tmp_path):
  architecture, hf_dir, _ = checkpoint
  model, cfg = convert.import_checkpoint(hf_dir)
  with pytest.raises(ValueError, match="moe_stack/mlp/router_bias .* is absent"):
    convert.export_checkpoint(nnx.state(model, nnx.Param), cfg, str(tmp_path), architecture)
  with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM cannot represent model.attention_type='mla'"):
    convert.export_checkpoint(model, cfg, str(tmp_path), "Qwen3MoeForCausalLM")
