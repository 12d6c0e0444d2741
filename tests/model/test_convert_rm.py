"""Reward models in Hugging Face's sequence-classification layout (Qwen3MoeForSequenceClassification):
an imported model scores as transformers does, export round-trips, and what the layout cannot hold
is refused by name."""

import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshrl.model import convert  # noqa: E402
from meshrl.sharding import make_mesh  # noqa: E402
from meshrl.train.reward_model import make_scorer  # noqa: E402

ARCH = "Qwen3MoeForSequenceClassification"
VOCAB, PAD = 128, 0
LENGTHS = np.array([16, 9, 3, 12])


def _hf_config(**changes):
  fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False,
                num_labels=1, pad_token_id=PAD)
  return transformers.Qwen3MoeConfig(**{**fields, **changes})


def _tokens():
  """[4, 16] right-padded rows of LENGTHS real tokens (never the pad id)."""
  tokens = np.random.RandomState(0).randint(1, VOCAB, (4, 16))
  tokens[np.arange(16)[None, :] >= LENGTHS[:, None]] = PAD
  return tokens


def _hf_scores(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(_tokens())).logits.numpy()[:, 0]  # [B, num_labels=1] -> [B]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
  """(HF folder, HF scores on _tokens()) of a tiny random Qwen3MoeForSequenceClassification."""
  torch.manual_seed(0)
  model = transformers.AutoModelForSequenceClassification.from_config(
      _hf_config(), attn_implementation="eager").float().eval()
  with torch.no_grad():
    model.score.weight.normal_(0.0, 1.0)  # a head far from zero: a zero-initialised import would fail
  folder = str(tmp_path_factory.mktemp("qwen3_moe_rm"))
  model.save_pretrained(folder)
  return folder, _hf_scores(model)


def _scores(model, mesh=None, cfg=None) -> np.ndarray:
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  rules = None
  if mesh is not None:
    from meshrl.sharding.rules import rules_from_config  # pylint: disable=import-outside-toplevel
    rules = rules_from_config(cfg.mesh)
  return np.asarray(make_scorer(graphdef, mesh, rules)(params, extra, _tokens(), LENGTHS))


def test_import_scores_like_transformers(reward_model):
  folder, hf_scores = reward_model
  model, cfg = convert.import_checkpoint(folder)
  assert cfg.model.value_head and cfg.model.tie_embeddings and model.lm_head is None
  scores = _scores(model)
  print(f"max |meshrl - HF| = {np.abs(scores - hf_scores).max():.2e}")
  np.testing.assert_allclose(scores, hf_scores, atol=1e-4, rtol=0)
  # The score is read at each row's own last token: the last column would differ for padded rows.
  graphdef, state = nnx.split(model)
  values = np.asarray(nnx.merge(graphdef, state)(_tokens(), return_hidden=True).values)
  assert np.abs(values[:, -1] - hf_scores)[LENGTHS < 16].min() > 1e-3


def test_import_on_the_mesh_scores_like_transformers(reward_model, devices):
  del devices
  folder, hf_scores = reward_model
  cfg = convert.load_hf_config(folder)
  with cfg.unlocked():
    cfg.mesh.update(fsdp=2, expert=2, tensor=2)
  mesh = make_mesh(cfg.mesh)
  model, _ = convert.import_checkpoint(folder, mesh, cfg)
  assert len(model.value_head.kernel[...].addressable_shards) == 8
  np.testing.assert_allclose(_scores(model, mesh, cfg), hf_scores, atol=1e-4, rtol=0)


def test_export_round_trip(reward_model, tmp_path):
  folder, hf_scores = reward_model
  model, cfg = convert.import_checkpoint(folder)
  written = convert.export_checkpoint(model, cfg, str(tmp_path), ARCH, pad_token_id=PAD)
  hf_config = json.loads((tmp_path / "config.json").read_text())
  assert hf_config["architectures"] == [ARCH] and hf_config["pad_token_id"] == PAD
  assert len(hf_config["id2label"]) == 1 and any(p.endswith("model.safetensors") for p in written)
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
  np.testing.assert_array_equal(_hf_scores(reloaded), hf_scores)
  again, _ = convert.import_checkpoint(str(tmp_path), cfg=cfg)
  before, after = dict(nnx.to_flat_state(nnx.state(model))), dict(nnx.to_flat_state(nnx.state(again)))
  assert before.keys() == after.keys()
  for path in before:
    np.testing.assert_array_equal(np.asarray(after[path][...]), np.asarray(before[path][...]),
                                  err_msg="/".join(path))


def test_causal_lm_import_keeps_its_lm_head_and_a_zero_value_head(reward_model, tmp_path):
  """The causal layout is unchanged: lm_head read from lm_head.weight, the value head at zero, and
  an RM export of it writes the value head as `score` (here zero) and leaves lm_head out."""
  torch.manual_seed(1)
  causal = transformers.AutoModelForCausalLM.from_config(
      _hf_config(num_labels=2), attn_implementation="eager").float().eval()
  causal.save_pretrained(str(tmp_path / "causal"))
  cfg = convert.load_hf_config(str(tmp_path / "causal"))
  with cfg.unlocked():
    cfg.model.value_head = True
  model, _ = convert.import_checkpoint(str(tmp_path / "causal"), cfg=cfg)
  np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), causal.lm_head.weight.detach().numpy().T)
  assert not np.any(np.asarray(model.value_head.kernel[...]))
  convert.export_checkpoint(model, cfg, str(tmp_path / "rm"), ARCH, pad_token_id=PAD)
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path / "rm"), dtype=torch.float32)
  assert not reloaded.score.weight.detach().numpy().any()
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  assert "lm_head.weight" not in load_file(str(tmp_path / "rm" / "model.safetensors"))


def test_refusals(reward_model, tmp_path):
  folder, _ = reward_model
  _hf_config(num_labels=3, architectures=[ARCH]).save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match=f"{ARCH} with num_labels=3: a reward model has one score"):
    convert.load_hf_config(str(tmp_path))
  model, cfg = convert.import_checkpoint(folder)
  with cfg.unlocked():
    cfg.model.value_head = False
  state = {k: v for k, v in nnx.to_flat_state(nnx.state(model)) if k[0] != "value_head"}
  with pytest.raises(ValueError, match=f"{ARCH} cannot represent model.value_head=False"):
    convert.export_checkpoint(nnx.from_flat_state(state), cfg, str(tmp_path / "out"), ARCH)
  with cfg.unlocked():
    cfg.model.value_head, cfg.model.qk_norm = True, False
  with pytest.raises(ValueError, match=rf"{ARCH} cannot represent model.qk_norm=False"):
    convert.export_checkpoint(model, cfg, str(tmp_path / "out"), ARCH)
