"""model.init_from / model.tokenizer: HF import at transformers' logits, checkpoint restore onto
another mesh, and every bad input refused by name before anything is compiled or written."""

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from meshrl import configs
from meshrl.sharding import make_mesh
from meshrl.train import init_from
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.init_from import check_initial_model, initial_model
from meshrl.train.state import create_train_state

TOKENS = np.random.RandomState(0).randint(0, 300, (2, 12))


def _logits(model, tokens=TOKENS):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, tokens))


def _flat(model):
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


def _hf_config(folder, *overrides):
  return configs.load(f"configs/hf_qwen3_moe.py:{folder}", ["model.dtype=float32", *overrides])


def _listing(folder):
  return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


def test_hf_folder_imports_at_transformers_logits(tiny_qwen3_moe, hf_fixtures, devices):
  del devices
  cfg = _hf_config(tiny_qwen3_moe.path, "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
  assert cfg.model.init_from == cfg.model.tokenizer == tiny_qwen3_moe.path and cfg.model.vocab_size == 320
  check_initial_model(cfg)
  model = initial_model(cfg, make_mesh(cfg.mesh))
  assert model.moe_stack.mlp.gate[...].sharding.spec[1] == "expert"
  diff = np.abs(_logits(model) - hf_fixtures.hf_logits(tiny_qwen3_moe.path, TOKENS)).max()
  print(f"max |meshrl - transformers| = {diff:.2e}")
  assert diff <= 1e-4


def test_checkpoint_restores_saved_params_on_another_mesh(tiny_qwen3_moe, tmp_path, devices):
  del devices
  cfg = _hf_config(tiny_qwen3_moe.path, "mesh.fsdp=8")
  mesh = make_mesh(cfg.mesh)
  model = initial_model(cfg, mesh)  # the HF import: no compile
  _, state = create_train_state(model, optax.sgd(0.1), mesh)
  with Checkpointer(str(tmp_path / "checkpoints"), every=1, async_save=False) as ckpt:
    ckpt.save(4, state, config=cfg)
  saved = _flat(model)
  for source in (str(tmp_path), str(tmp_path / "checkpoints")):  # the workdir or its checkpoints
    cfg2 = _hf_config(tiny_qwen3_moe.path, f"model.init_from={source}", "mesh.fsdp=2",
                      "mesh.expert=2", "mesh.tensor=2")
    check_initial_model(cfg2)
    restored = initial_model(cfg2, make_mesh(cfg2.mesh))
    got = _flat(restored)
    assert got.keys() == saved.keys()
    for path, value in saved.items():
      np.testing.assert_array_equal(got[path], value, err_msg="/".join(path))
    experts = restored.moe_stack.mlp.gate[...]
    assert experts.sharding.spec[1] == "expert" and experts.sharding.mesh.shape["tensor"] == 2
  cfg3 = _hf_config(tiny_qwen3_moe.path, f"model.init_from={tmp_path}", "model.value_head=true")
  with_head = initial_model(cfg3, None)  # a critic head the checkpoint lacks starts at zero
  assert not np.asarray(with_head.value_head.kernel[...]).any()
  np.testing.assert_array_equal(np.asarray(with_head.embed.embedding[...]), saved[("embed", "embedding")])
  bad = _hf_config(tiny_qwen3_moe.path, f"model.init_from={tmp_path}", "moe.num_experts_per_tok=1")
  with pytest.raises(ValueError, match=r"step 4 was saved with another model: "
                                       r"moe.num_experts_per_tok=1 \(checkpoint: 2\)"):
    check_initial_model(bad)


def test_random_init_when_init_from_is_empty(monkeypatch):
  built = []
  monkeypatch.setattr(init_from, "build_model",
                      lambda mc, mesh, *, seed, rules: built.append((mc.num_layers, mesh, seed)))
  cfg = configs.load("configs/tiny.py", ["seed=5", "model.num_layers=3"])
  check_initial_model(cfg)
  initial_model(cfg, None)
  assert built == [(3, None, 5)]


def _template_folder(tiny, tmp_path, name, template):
  folder = tmp_path / name
  shutil.copytree(tiny.path, folder)
  (folder / "chat_template.jinja").write_text(template)
  return str(folder)


def _llama_folder(tmp_path):
  folder = tmp_path / "llama"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "model_type": "llama"}))
  return str(folder)


@pytest.mark.parametrize("case", ["missing", "llama", "mismatch", "no_weights", "vocab", "template",
                                  "empty_template", "no_tokenizer", "not_a_model"])
def test_bad_input_is_named_before_anything_happens(case, tiny_qwen3_moe, tmp_path):
  tiny = tiny_qwen3_moe
  cfg_overrides, error = {
      "missing": ([f"model.init_from={tmp_path}/nope"], r"model.init_from='.*/nope' does not exist"),
      "llama": ([f"model.init_from={_llama_folder(tmp_path)}"],
                r"model.init_from='.*llama': architecture 'LlamaForCausalLM' is not supported; "
                "supported: Qwen3MoeForCausalLM, DeepseekV3ForCausalLM"),
      "mismatch": (["model.num_layers=3"], r"model.init_from=.*model.num_layers=3 \(checkpoint: 2\)"),
      "no_weights": (None, "has a config.json but no model.safetensors"),
      "vocab": (["model.init_from=", "model.vocab_size=299"],  # 297 learnt tokens + 3 specials
                r"model.tokenizer='.*' has 300 tokens, more than model.vocab_size=299"),
      "template": ([f"model.tokenizer={_template_folder(tiny, tmp_path, 'bad', '{{ m | no_such_filter }}')}"],
                   r"model.tokenizer=.*chat_template.jinja does not compile.*no_such_filter"),
      "empty_template": ([f"model.tokenizer={_template_folder(tiny, tmp_path, 'empty', '{# nothing #}')}"],
                         r"model.tokenizer=.*renders to '', which encodes to no tokens"),
      "no_tokenizer": ([f"model.tokenizer={tmp_path}/none.json"],
                       r"model.tokenizer='.*none.json': tokenizer=.* is neither 'byte' nor"),
      "not_a_model": ([f"model.init_from={tmp_path}"], "is neither a Hugging Face folder"),
  }[case]
  if case == "no_weights":
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(os.path.join(tiny.path, "config.json"), folder)
    cfg = _hf_config(tiny.path, f"model.init_from={folder}")
  else:
    cfg = _hf_config(tiny.path, *cfg_overrides)
  before = _listing(tmp_path), _listing(tiny.path)
  with pytest.raises(ValueError, match=error):
    check_initial_model(cfg)
  assert (_listing(tmp_path), _listing(tiny.path)) == before  # nothing written
  if case in ("missing", "llama", "mismatch", "no_weights", "not_a_model"):
    with pytest.raises(ValueError, match=error):
      initial_model(cfg, None)  # refuses before building anything


def test_preset_needs_a_qwen3_moe_folder(tmp_path):
  with pytest.raises(configs.ConfigError, match="needs the model folder"):
    configs.load("configs/hf_qwen3_moe.py")
  with pytest.raises(configs.ConfigError, match="holds model_type='llama', not 'qwen3_moe'"):
    configs.load(f"configs/hf_qwen3_moe.py:{_llama_folder(tmp_path)}")
  with pytest.raises(configs.ConfigError, match="config.json does not exist"):
    configs.load(f"configs/hf_qwen3_moe.py:{tmp_path}/none")
