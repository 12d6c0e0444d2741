"""Config loading, overrides and their errors; every preset loads."""

import glob
import json
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from meshrl import configs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A preset is a configs/*.py with get_config (as configs/loader.py lists them); the other modules there
# (loader, cli, checks, hugepages, hf_config) are the config machinery.
PRESETS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
                 if not os.path.basename(p).startswith("_")
                 and re.search(r"^def get_config", open(p, encoding="utf-8").read(), re.M))


NEEDS_ARGUMENT = {"hf_qwen3_moe"}  # loaded with a model folder in tests/train/test_init_from.py


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_locked(preset):
  if preset in NEEDS_ARGUMENT:
    with pytest.raises(configs.ConfigError, match="needs the model folder"):
      configs.load(f"configs/{preset}.py")
    return
  config = configs.load(f"configs/{preset}.py")
  assert isinstance(config, ml_collections.ConfigDict)
  with pytest.raises((AttributeError, KeyError)):
    config.model.no_such_field = 1


def test_override_changes_value_and_keeps_type():
  config = configs.load("configs/tiny.py", ["model.num_layers=3", "optim.learning_rate=1",
                                            "model.qk_norm=true", "data.tasks=reverse:1.0"])
  assert config.model.num_layers == 3
  assert isinstance(config.optim.learning_rate, float) and config.optim.learning_rate == 1.0
  assert config.model.qk_norm is True
  assert config.data.tasks == "reverse:1.0"


def test_preset_argument_through_base():
  assert configs.load("configs/base.py:tiny").name == "tiny"
  assert configs.load("configs/tiny.py:dense").moe.num_experts == 0


def test_peer_preset_is_the_issue_shape_and_passes_the_run_check():
  """configs/tiny.py:peer holds the shape issue 9 times the peers at, and a run would accept it."""
  from meshrl.rl.step.driver import check_config  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py:peer")
  m, moe, rl = cfg.model, cfg.moe, cfg.rl
  assert (m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim) == (4, 256, 8, 4, 32)
  assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_mlp_dim, moe.first_k_dense) == (8, 2, 512, 0)
  assert (rl.prompts_per_step, rl.group_size, rl.max_prompt_len, rl.max_new_tokens) == (8, 4, 16, 64)
  assert rl.kl_coef > 0 and rl.num_minibatches == 1 and cfg.mesh.fsdp == 2
  check_config(cfg, num_devices=2)


def test_unknown_key_names_key_and_closest():
  with pytest.raises(configs.ConfigError, match=r"'model.num_layer'.*'model.num_layers'"):
    configs.load("configs/tiny.py", ["model.num_layer=2"])


def test_wrong_type_names_field_and_type():
  with pytest.raises(configs.ConfigError, match=r"model.num_layers expects int"):
    configs.load("configs/tiny.py", ["model.num_layers=two"])
  with pytest.raises(configs.ConfigError, match=r"model.qk_norm expects a bool"):
    configs.load("configs/tiny.py", ["model.qk_norm=maybe"])
  with pytest.raises(configs.ConfigError, match=r"model.num_layers expects int"):
    configs.load("configs/tiny.py", ["model.num_layers=2.5"])


def test_missing_file_lists_presets():
  with pytest.raises(configs.ConfigError, match="tiny"):
    configs.load("configs/nope.py")


def test_diff_and_save(tmp_path):
  config = configs.load("configs/tiny.py", ["model.num_layers=5"])
  diff = configs.config_diff(config, configs.load_preset("base"))
  assert diff["model.num_layers"] == (4, 5)
  path = configs.save_config(config, str(tmp_path))
  with open(path) as f:
    assert json.load(f)["model"]["num_layers"] == 5


def _show_config(*flags):
  env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "show_config.py"), *flags],
                        capture_output=True, text=True, env=env, cwd="/tmp", timeout=300)


def test_cli_unknown_key_exits_nonzero():
  result = _show_config("--config=configs/tiny.py", "--config.model.nonexistant=1")
  assert result.returncode != 0
  assert "model.nonexistant" in result.stderr and "did you mean" in result.stderr


def test_cli_bad_mesh_exits_nonzero_naming_sizes():
  result = _show_config("--cpu_devices=8", "--config=configs/tiny.py", "--config.mesh.fsdp=3")
  assert result.returncode != 0
  assert "fsdp=3" in result.stderr and "8 devices" in result.stderr


def test_cli_prints_mesh():
  result = _show_config("--cpu_devices=8", "--config=configs/tiny.py", "--config.mesh.tensor=2")
  assert result.returncode == 0, result.stderr
  assert "tensor: 2" in result.stdout and "fsdp: 4" in result.stdout
  assert "mesh.tensor: 1 -> 2" in result.stdout
