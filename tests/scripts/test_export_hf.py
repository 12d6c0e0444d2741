"""scripts/export_hf.py: a meshrl checkpoint becomes a folder transformers loads at meshrl's logits,
with the tokenizer and chat template beside it; bad flags are one line each, nothing written."""

import importlib.util
import os
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.tokenizer import HFTokenizer
from meshrl.sharding import make_mesh
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.init_from import initial_model
from meshrl.train.state import create_train_state

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = np.random.RandomState(1).randint(0, 300, (2, 12))


def _script():
  spec = importlib.util.spec_from_file_location("export_hf", os.path.join(REPO, "scripts", "export_hf.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _logits(model):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, TOKENS))


@pytest.fixture(scope="module")
def trained(tiny_qwen3_moe, tmp_path_factory):
  """(workdir, meshrl logits): the tiny HF model with changed weights, saved as step 7."""
  cfg = configs.load(f"configs/hf_qwen3_moe.py:{tiny_qwen3_moe.path}", ["model.dtype=float32"])
  mesh = make_mesh(cfg.mesh)
  model = initial_model(cfg, mesh)
  rng = np.random.RandomState(0)
  for variable in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    value = variable[...]
    noise = (1 + 0.1 * rng.randn(*value.shape)).astype(value.dtype)  # new weights, as training makes
    variable[...] = jax.device_put(np.asarray(value) * noise, value.sharding)
  _, state = create_train_state(model, optax.sgd(0.1), mesh)
  workdir = tmp_path_factory.mktemp("trained")
  with Checkpointer(str(workdir / "checkpoints"), every=1, async_save=False) as ckpt:
    ckpt.save(7, state, config=cfg)
  return str(workdir), _logits(model)


def test_export_loads_in_transformers_at_meshrl_logits(trained, tiny_qwen3_moe, hf_fixtures, tmp_path,
                                                       capsys):
  workdir, logits = trained
  out = str(tmp_path / "hf")
  rc = _script().main([f"--config=configs/hf_qwen3_moe.py:{tiny_qwen3_moe.path}", f"--checkpoint={workdir}",
                       f"--out={out}"])
  assert rc == 0, capsys.readouterr().err
  assert "Qwen3MoeForCausalLM" in capsys.readouterr().out
  exported = hf_fixtures.hf_logits(out, TOKENS)
  diff = np.abs(exported - logits).max()
  print(f"max |transformers(exported) - meshrl| = {diff:.2e}")
  assert diff <= 1e-4
  assert np.abs(exported - hf_fixtures.hf_logits(tiny_qwen3_moe.path, TOKENS)).max() > 1e-2  # new weights
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    with open(os.path.join(out, name), "rb") as a, open(os.path.join(tiny_qwen3_moe.path, name), "rb") as b:
      assert a.read() == b.read(), name
  messages = [{"role": "user", "content": "12+7="}]
  reference = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert HFTokenizer(out).render_prompt("12+7=") == reference


def test_bad_flags_are_one_line_and_write_nothing(trained, tiny_qwen3_moe, tmp_path, capsys):
  workdir, _ = trained
  config = f"--config=configs/hf_qwen3_moe.py:{tiny_qwen3_moe.path}"
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("x")
  cases = {
      "exists and is not empty": [f"--checkpoint={workdir}", f"--out={tmp_path}/full"],
      "--checkpoint='/no/such' does not exist": ["--checkpoint=/no/such", f"--out={tmp_path}/a"],
      "holds no meshrl checkpoint": [f"--checkpoint={tmp_path}", f"--out={tmp_path}/b"],
      r"--step=3 is not in .*saved steps: \[7\]": [f"--checkpoint={workdir}", f"--out={tmp_path}/c",
                                                   "--step=3"],
      r"step 7 was saved with another model: moe.num_experts=8 \(checkpoint: 4\)": None,
      "'GPT2LMHeadModel' is not supported": [f"--checkpoint={workdir}", f"--out={tmp_path}/e",
                                             "--architecture=GPT2LMHeadModel"],
      r"DeepseekV3ForCausalLM cannot represent model.attention_type='gqa'": [
          f"--checkpoint={workdir}", f"--out={tmp_path}/f", "--architecture=DeepseekV3ForCausalLM"],
      # int8 without scales wrote weights that were 99.7% zeros, and exited 0.
      r"--dtype='int8' cannot hold the weights .*choose one of float32, bfloat16, float16": [
          f"--checkpoint={workdir}", f"--out={tmp_path}/h", "--dtype=int8"],
      r"--dtype='int4' cannot hold the weights": [f"--checkpoint={workdir}", f"--out={tmp_path}/i", "--dtype=int4"],
      "is a file; give a new or empty folder": [f"--checkpoint={workdir}", f"--out={tmp_path}/full/keep.txt"],
  }
  script = _script()
  for error, argv in cases.items():
    if argv is None:  # a config that does not fit the checkpoint
      argv = [f"--checkpoint={workdir}", f"--out={tmp_path}/d", "--config.moe.num_experts=8"]
    assert script.cli.run(script.main, [config, *argv]) == 2, error
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(error, err), (error, err)
  with pytest.raises(SystemExit):
    script.cli.run(script.main, [config, f"--checkpoint={workdir}", f"--out={tmp_path}/g",
                                 "--config.model.no_such=1"])
  assert "unknown config key 'model.no_such'" in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path)) == ["full"] and os.listdir(tmp_path / "full") == ["keep.txt"]
