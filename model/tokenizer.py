"""Tokenizers: a byte-level default that needs no download, and Hugging Face `tokenizer.json` files.

Both share `Tokenizer`: `encode`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`, plus batch
encoding to fixed-length numpy arrays (left padding for prompts before generation, right padding
for training targets) and batch decoding.

Byte ids: 0..255 are the UTF-8 bytes, then BOS = 256, EOS = 257, PAD = 258 (vocab 259).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np


class Tokenizer:
  """Base class: subclasses set `vocab_size`, `bos_id` (or None), `eos_id`, `pad_id` and implement
  `_text_ids(text) -> list[int]` (no specials) and `_ids_text(ids) -> str` (specials removed)."""

  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int

  def _text_ids(self, text: str) -> list[int]:
    raise NotImplementedError

  def _ids_text(self, ids: list[int]) -> str:
    raise NotImplementedError

  def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    """Token ids of `text`, with BOS first (when the tokenizer has one) and optionally EOS last."""
    ids = self._text_ids(text)
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids + [self.eos_id] if add_eos else ids

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
    """Text of `ids`: stops at the first EOS (or drops EOS), and drops BOS and PAD."""
    specials = {self.bos_id, self.eos_id, self.pad_id}
    kept = []
    for token in (int(i) for i in np.asarray(ids).reshape(-1)):
      if token == self.eos_id and stop_at_eos:
        break
      if token not in specials:
        kept.append(token)
    return self._ids_text(kept)

  def decode_batch(self, ids, *, stop_at_eos: bool = True) -> list[str]:
    """`[B, L]` ids -> B strings."""
    return [self.decode(row, stop_at_eos=stop_at_eos) for row in np.asarray(ids)]

  def encode_batch(self, texts: Sequence[str], *, length: int | None = None,
                   padding: str = "left", add_bos: bool = True, add_eos: bool = False,
                   overflow: str = "truncate") -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads to one length.

    Args:
      texts: B strings.
      length: L; None pads to the longest encoding.
      padding: "left" (prompts for generation: the last column is the last prompt token) or
        "right" (training targets).
      add_bos: prepend BOS.
      add_eos: append EOS.
      overflow: an encoding longer than L is cut to its last L tokens, keeping a leading BOS
        ("truncate", like cfg.rl.prompt_overflow) or raises ValueError ("reject").

    Returns:
      (ids [B, L] int32 with PAD in the padding, mask [B, L] bool, True on real tokens).
    """
    if padding not in ("left", "right"):
      raise ValueError(f"padding={padding!r} must be 'left' or 'right'.")
    if overflow not in ("truncate", "reject"):
      raise ValueError(f"overflow={overflow!r} must be 'truncate' or 'reject'.")
    encoded = [self.encode(text, add_bos=add_bos, add_eos=add_eos) for text in texts]
    if length is None:
      length = max((len(ids) for ids in encoded), default=0)
    if length < 1:
      raise ValueError(f"length={length} must be at least 1.")
    ids_out = np.full((len(texts), length), self.pad_id, np.int32)
    mask_out = np.zeros((len(texts), length), bool)
    for row, ids in enumerate(encoded):
      if len(ids) > length:
        if overflow == "reject":
          raise ValueError(f"text {row} encodes to {len(ids)} tokens, over length={length}: "
                           f"{texts[row][:40]!r}")
        keep_bos = add_bos and self.bos_id is not None and length > 1
        ids = [ids[0]] + ids[len(ids) - length + 1:] if keep_bos else ids[len(ids) - length:]
      start = length - len(ids) if padding == "left" else 0
      ids_out[row, start:start + len(ids)] = ids
      mask_out[row, start:start + len(ids)] = True
    return ids_out, mask_out


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes 0..255, BOS 256, EOS 257, PAD 258; invalid UTF-8 decodes to U+FFFD."""

  vocab_size = 259
  bos_id = 256
  eos_id = 257
  pad_id = 258

  def _text_ids(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def _ids_text(self, ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# Special-token spellings tried, in order, when an HFTokenizer is not told its ids.
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "<|bos|>")
_EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "[EOS]", "<|eos|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library) behind the `Tokenizer` interface.

  Special ids come from the arguments (an id or a token string), else from a
  `tokenizer_config.json` beside the file ("bos_token", "eos_token", "pad_token"), else from common
  spellings ("<s>", "</s>", "<pad>", "<|endoftext|>", ...). EOS is required; PAD defaults to EOS;
  BOS may be absent (then `add_bos` adds nothing). The file's own post-processor is bypassed so
  BOS is never added twice.

  Args:
    path: a tokenizer.json, or a folder holding one.
    bos, eos, pad: optional id (int) or token string.
  """

  def __init__(self, path: str, *, bos: int | str | None = None, eos: int | str | None = None,
               pad: int | str | None = None):
    import tokenizers  # pylint: disable=import-outside-toplevel  (optional dependency)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise ValueError(
          f"tokenizer path={path!r} is neither a tokenizer.json nor a folder with one.")
    self._tokenizer = tokenizers.Tokenizer.from_file(file)
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    config = self._sibling_config(file)
    self.bos_id = self._special_id("bos", bos, config.get("bos_token"), _BOS_NAMES)
    self.eos_id = self._special_id("eos", eos, config.get("eos_token"), _EOS_NAMES)
    self.pad_id = self._special_id("pad", pad, config.get("pad_token"), _PAD_NAMES)
    if self.eos_id is None:
      raise ValueError(f"no EOS token found in {file!r} (tried {_EOS_NAMES}); pass eos=.")
    if self.pad_id is None:
      self.pad_id = self.eos_id

  @staticmethod
  def _sibling_config(file: str) -> dict:
    config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if not os.path.isfile(config_file):
      return {}
    with open(config_file, encoding="utf-8") as handle:
      return json.load(handle)

  def _special_id(self, role: str, given, from_config, names) -> int | None:
    """Resolves one special token: argument, then tokenizer_config.json, then common names."""
    if isinstance(from_config, dict):  # {"content": "<s>", ...} form
      from_config = from_config.get("content")
    for candidate in ([given] if given is not None else [from_config, *names]):
      if candidate is None:
        continue
      if isinstance(candidate, int):
        if not 0 <= candidate < self.vocab_size:
          raise ValueError(
              f"{role}={candidate} is outside the vocabulary (size {self.vocab_size}).")
        return candidate
      token_id = self._tokenizer.token_to_id(candidate)
      if token_id is not None:
        return token_id
      if given is not None:
        raise ValueError(f"{role}={given!r} is not a token of this tokenizer.")
    return None

  def _text_ids(self, text: str) -> list[int]:
    return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

  def _ids_text(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(name: str = "byte", **special_ids) -> Tokenizer:
  """'byte' -> ByteTokenizer(); a tokenizer.json path or folder -> HFTokenizer(path, ...)."""
  if name == "byte":
    return ByteTokenizer()
  if os.path.exists(name):
    return HFTokenizer(name, **special_ids)
  raise ValueError(f"tokenizer={name!r} is neither 'byte' nor an existing tokenizer.json path.")
