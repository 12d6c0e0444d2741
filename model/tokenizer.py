"""Tokenizers: a byte-level default that needs no download, and Hugging Face `tokenizer.json` files.

Both share `Tokenizer`: `encode`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`, plus batch
encoding to fixed-length numpy arrays (left padding for prompts before generation, right padding
for training targets) and batch decoding; `stop_ids` (the tokens that end a response: EOS and, for
chat models, the end-of-turn token), `has_chat_template` and `render_prompt(text)` (the prompt as
one user turn of the model's chat template, model/chat_template.py; the text itself without one).

  tokenizer = tokenizer_from_config(cfg)        # cfg.model.tokenizer: "byte" or a tokenizer.json
  ids = tokenizer.encode(tokenizer.render_prompt("12+7="))

Byte ids: 0..255 are the UTF-8 bytes, then BOS = 256, EOS = 257, PAD = 258 (vocab 259).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np

from meshrl.model.chat_template import ChatTemplate, load_chat_template


class Tokenizer:
  """Base class: subclasses set `vocab_size`, `bos_id` (or None), `eos_id`, `pad_id` and implement
  `_text_ids(text) -> list[int]` (no specials) and `_ids_text(ids) -> str` (specials removed).

  `vocab_size` is one more than the largest id (added tokens included), the least
  model.vocab_size that can embed every id. `stop_ids` defaults to (eos_id,).
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int
  has_chat_template: bool = False

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Token ids that end a response; EOS first."""
    return (self.eos_id,)

  def render_prompt(self, text: str) -> str:
    """`text` as the model's prompt: one user turn of its chat template, or `text` itself."""
    return text

  def _text_ids(self, text: str) -> list[int]:
    raise NotImplementedError

  def _ids_text(self, ids: list[int]) -> str:
    raise NotImplementedError

  def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    """Token ids of `text`, with BOS first (when the tokenizer has one and `text` does not already
    begin with it, as a chat template's rendering may) and optionally EOS last."""
    ids = self._text_ids(text)
    if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    return ids + [self.eos_id] if add_eos else ids

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
    """Text of `ids`: stops at the first stop token (or drops them), and drops BOS and PAD."""
    stops = set(self.stop_ids)
    specials = {self.bos_id, self.pad_id} | stops
    kept = []
    for token in (int(i) for i in np.asarray(ids).reshape(-1)):
      if token in stops and stop_at_eos:
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

  Beside the file, a chat template (tokenizer_config.json or chat_template.jinja) makes
  `render_prompt` render one user turn with add_generation_prompt=True, and `stop_ids` gather EOS,
  generation_config.json's "eos_token_id" (an id or a list) and the template's end-of-turn token
  (the special token it writes right after an assistant message, e.g. <|im_end|>).

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
    self.file = file
    self._tokenizer = tokenizers.Tokenizer.from_file(file)
    self.vocab_size = 1 + max(self._tokenizer.get_vocab(with_added_tokens=True).values())
    config = self._sibling_config(file)
    self.bos_id = self._special_id("bos", bos, config.get("bos_token"), _BOS_NAMES)
    self.eos_id = self._special_id("eos", eos, config.get("eos_token"), _EOS_NAMES)
    self.pad_id = self._special_id("pad", pad, config.get("pad_token"), _PAD_NAMES)
    if self.eos_id is None:
      raise ValueError(f"no EOS token found in {file!r} (tried {_EOS_NAMES}); pass eos=.")
    if self.pad_id is None:
      self.pad_id = self.eos_id
    folder = os.path.dirname(file)
    self.chat_template: ChatTemplate | None = load_chat_template(folder)
    self.has_chat_template = self.chat_template is not None
    stops = [self.eos_id, *self._generation_eos_ids(folder)]
    end_of_turn = self._end_of_turn_id()
    self._stop_ids = tuple(dict.fromkeys(stops + ([end_of_turn] if end_of_turn is not None else [])))

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stop_ids

  def render_prompt(self, text: str) -> str:
    if self.chat_template is None:
      return text
    return self.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True)

  def _generation_eos_ids(self, folder: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), each checked against the vocab."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
      return []
    with open(path, encoding="utf-8") as handle:
      eos = json.load(handle).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"{path}: eos_token_id {bad} outside the vocabulary (size {self.vocab_size}).")
    return ids

  def _end_of_turn_id(self) -> int | None:
    """The special token the chat template writes right after an assistant message, if any.

    Found by rendering a two-turn conversation whose assistant text is a marker and reading the
    first token after the marker; a template that cannot render it has none.
    """
    if self.chat_template is None:
      return None
    marker = "MESHRL_END_OF_TURN_PROBE"
    try:
      text = self.chat_template.render([{"role": "user", "content": "1+1="},
                                        {"role": "assistant", "content": marker}],
                                       add_generation_prompt=False)
    except ValueError:
      return None
    _, found, after = text.rpartition(marker)
    ids = self._text_ids(after.lstrip(" ")) if found else []
    specials = {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
    return ids[0] if ids and ids[0] in specials else None

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


def tokenizer_from_config(cfg) -> Tokenizer:
  """The run's tokenizer, `cfg.model.tokenizer`; errors name the field and its value."""
  name = cfg.model.tokenizer
  try:
    return load_tokenizer(name)
  except ValueError as e:
    raise ValueError(f"model.tokenizer={name!r}: {e}") from None
  except Exception as e:  # pylint: disable=broad-except  (the tokenizers library raises plain Exception)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise ValueError(f"model.tokenizer={name!r} cannot be read as a tokenizer.json ({first}).") from None
