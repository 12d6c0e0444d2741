"""A reward model loaded beside a policy must read the policy's tokens: another tokenizer, a smaller
vocabulary, a checkpoint without a score head or a folder that is neither kind is refused by name."""

import os
import shutil

import jax.numpy as jnp
import pytest

from meshrl import configs
from meshrl.model.tokenizer import load_tokenizer
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.rm_source import check_reward_model

FIELD = "rl.reward_model_checkpoint"


def _policy(**model):
  cfg = configs.load("configs/tiny.py")
  with cfg.unlocked():
    cfg.model.update(model)
  return cfg


def _save_rm(folder, **model) -> str:
  """A checkpoint folder whose saved config is the tiny RM's with `model` changes (one tiny array:
  these checks read the config and tokenizer only)."""
  cfg = configs.load("configs/tiny_rm.py")
  with cfg.unlocked():
    cfg.model.update({"value_head": True, **model})  # the reward model's config (rl/rewards/rm_job.reward_model_config)
  with Checkpointer(os.path.join(folder, "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, {"params": {"x": jnp.zeros(2)}}, config=cfg, force=True)
  return str(folder)


@pytest.fixture(scope="module")
def tokenizers(hf_fixtures, tmp_path_factory):
  """Two copies of one tokenizer.json (different paths) and a different tokenizer."""
  folder = tmp_path_factory.mktemp("tokenizers")
  hf_fixtures.save_tokenizer(str(folder / "a"))
  shutil.copytree(folder / "a", folder / "a_copy")
  hf_fixtures.save_tokenizer(str(folder / "b"))
  with open(folder / "b" / "tokenizer.json", "a") as f:
    f.write(" ")  # same ids, other bytes: only contents equal to the byte count as "the same"
  return {name: str(folder / name / "tokenizer.json") for name in ("a", "a_copy", "b")}


def test_same_tokenizer_is_accepted_wherever_it_lies(tmp_path, tokenizers):
  path = _save_rm(tmp_path, tokenizer=tokenizers["a"], vocab_size=320)
  rm_cfg = check_reward_model(path, _policy(tokenizer=tokenizers["a_copy"], vocab_size=320))
  assert rm_cfg.model.value_head and rm_cfg.model.tokenizer == tokenizers["a"]
  assert check_reward_model(_save_rm(tmp_path / "byte"), _policy()).model.vocab_size == 259


@pytest.mark.parametrize("rm_tok, policy_tok", [("byte", "a"), ("a", "byte"), ("a", "b")])
def test_another_tokenizer_is_refused(tmp_path, tokenizers, rm_tok, policy_tok):
  rm_name, policy_name = (tokenizers.get(t, t) for t in (rm_tok, policy_tok))
  path = _save_rm(tmp_path, tokenizer=rm_name, vocab_size=320)
  with pytest.raises(ValueError) as error:
    check_reward_model(path, _policy(tokenizer=policy_name, vocab_size=320))
  message = str(error.value)
  assert message.startswith(f"{FIELD}={path!r}: the reward model's tokenizer {rm_name!r} differs from the "
                            f"policy's model.tokenizer={policy_name!r}"), message
  assert "\n" not in message


def test_smaller_vocabulary_and_missing_head_are_refused(tmp_path, tokenizers):
  path = _save_rm(tmp_path / "small", tokenizer=tokenizers["a"], vocab_size=200)
  ids = load_tokenizer(tokenizers["a"]).vocab_size
  assert ids > 200
  with pytest.raises(ValueError, match=rf"the reward model's model.vocab_size=200 cannot embed the policy "
                                       rf"tokenizer's {ids} ids"):
    check_reward_model(path, _policy(tokenizer=tokenizers["a"], vocab_size=320))
  path = _save_rm(tmp_path / "headless", value_head=False)
  with pytest.raises(ValueError, match=rf"{FIELD}='.*headless' was saved with model.value_head=False"):
    check_reward_model(path, _policy())


def test_not_a_reward_model_folder(tmp_path, tiny_qwen3_moe):
  with pytest.raises(ValueError, match=rf"{FIELD}='.*nope' does not exist"):
    check_reward_model(str(tmp_path / "nope"), _policy())
  with pytest.raises(ValueError, match="is neither a meshrl checkpoint .* nor a Hugging Face folder"):
    check_reward_model(str(tmp_path), _policy())
  # A Hugging Face causal LM has no score head (its config is the policy's, value_head=False).
  policy = _policy(tokenizer=tiny_qwen3_moe.path)
  with pytest.raises(ValueError, match="was saved with model.value_head=False"):
    check_reward_model(tiny_qwen3_moe.path, policy)
