"""Byte tokenizer and the Hugging Face tokenizer.json loader (built here, no downloads)."""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from meshrl.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_ids_and_specials():
  tok = ByteTokenizer()
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
  assert tok.encode("12+7=") == [256, 49, 50, 43, 55, 61]
  assert tok.encode("hi", add_bos=False, add_eos=True) == [104, 105, 257]
  assert tok.encode("é", add_bos=False) == [0xC3, 0xA9]


def test_byte_decode_stops_at_eos_and_drops_specials():
  tok = ByteTokenizer()
  assert tok.decode([256, 49, 57, 257, 50]) == "19"
  assert tok.decode([258, 258, 256, 104, 105]) == "hi"
  assert tok.decode([104, 257, 105], stop_at_eos=False) == "hi"
  assert tok.decode(np.array([0xC3])) == "\ufffd"  # a cut UTF-8 sequence does not raise
  for text in ["", "rev abc=", "naïve ∑"]:
    assert tok.decode(tok.encode(text, add_eos=True)) == text


def test_batch_left_and_right_padding():
  tok = ByteTokenizer()
  ids, mask = tok.encode_batch(["ab", "abcd"], length=6, padding="left")
  np.testing.assert_array_equal(ids, [[258, 258, 258, 256, 97, 98], [258, 256, 97, 98, 99, 100]])
  np.testing.assert_array_equal(mask, ids != 258)
  assert ids.dtype == np.int32 and mask.dtype == bool
  ids, mask = tok.encode_batch(["ab", "abcd"], padding="right", add_bos=False, add_eos=True)
  np.testing.assert_array_equal(ids, [[97, 98, 257, 258, 258], [97, 98, 99, 100, 257]])
  np.testing.assert_array_equal(mask.sum(1), [3, 5])
  assert tok.decode_batch(ids) == ["ab", "abcd"]


def test_batch_overflow_truncates_left_keeping_bos_or_rejects():
  tok = ByteTokenizer()
  ids, mask = tok.encode_batch(["abcdef"], length=4)
  np.testing.assert_array_equal(ids, [[256, 100, 101, 102]])
  assert mask.all()
  with pytest.raises(ValueError, match="over length=4"):
    tok.encode_batch(["abcdef"], length=4, overflow="reject")
  with pytest.raises(ValueError, match="padding='middle'"):
    tok.encode_batch(["a"], padding="middle")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny WordLevel tokenizer.json trained on a few strings."""
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
  tok.train_from_iterator(["one plus two is three", "two plus two is four"], trainer=trainer)
  folder = tmp_path_factory.mktemp("hf")
  tok.save(str(folder / "tokenizer.json"))
  return folder


def test_hf_tokenizer_specials_from_names(hf_dir):
  tok = HFTokenizer(str(hf_dir))
  raw = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (raw.token_to_id("<s>"), raw.token_to_id("</s>"),
                                                  raw.token_to_id("<pad>"))
  assert tok.vocab_size == raw.get_vocab_size()
  ids = tok.encode("two plus two")
  assert ids[0] == tok.bos_id and ids[1:] == raw.encode("two plus two").ids
  assert tok.decode(ids + [tok.eos_id, raw.token_to_id("four")]) == "two plus two"
  batch, mask = tok.encode_batch(["one", "two plus two"], padding="left")
  assert batch.shape == (2, 4) and batch[0, 0] == tok.pad_id and mask.sum() == 2 + 4
  assert tok.decode_batch(batch) == ["one", "two plus two"]
  assert isinstance(tok, Tokenizer) and isinstance(load_tokenizer(str(hf_dir)), HFTokenizer)


def test_hf_tokenizer_specials_from_args_and_config(hf_dir, tmp_path):
  raw = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
  tok = HFTokenizer(str(hf_dir / "tokenizer.json"), eos="<unk>", pad=raw.token_to_id("<s>"))
  assert (tok.eos_id, tok.pad_id) == (raw.token_to_id("<unk>"), raw.token_to_id("<s>"))
  (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": None, "eos_token": {"content": "<pad>"}}))
  tok = HFTokenizer(str(tmp_path))
  assert tok.eos_id == raw.token_to_id("<pad>")
  with pytest.raises(ValueError, match="eos='<end>'"):
    HFTokenizer(str(hf_dir), eos="<end>")
  with pytest.raises(ValueError, match="pad=999"):
    HFTokenizer(str(hf_dir), pad=999)
  with pytest.raises(ValueError, match="neither"):
    HFTokenizer(str(tmp_path / "missing.json"))


def test_load_tokenizer_byte_and_unknown():
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)
  with pytest.raises(ValueError, match="tokenizer='gpt9'"):
    load_tokenizer("gpt9")
