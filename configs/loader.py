"""Loads a preset file, applies `a.b=value` overrides with clear errors, and saves the result.

A preset is a Python file with `get_config(arg=None)` returning an `ml_collections.ConfigDict`;
`path:arg` passes `arg` (as ml_collections' config_flags does). The result is locked: later code can
read and set fields, never add them.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import math
import os
from typing import Any, Iterable

import ml_collections

_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
  """A config path, key or value that cannot be used; the message names it."""


def preset_path(name: str) -> str:
  """`tiny` -> the absolute path of configs/tiny.py."""
  return os.path.join(_CONFIG_DIR, f"{name}.py")


def _import_file(path: str):
  spec = importlib.util.spec_from_file_location(f"meshrl_preset_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _resolve_path(path: str) -> str:
  if os.path.exists(path):
    return path
  # "configs/tiny.py" from another directory, or a bare preset name.
  for candidate in (os.path.join(_CONFIG_DIR, os.path.basename(path)), preset_path(path)):
    if os.path.exists(candidate):
      return candidate
  presets = sorted(f[:-3] for f in os.listdir(_CONFIG_DIR) if f.endswith(".py") and not f.startswith("_")
                   and "def get_config" in open(os.path.join(_CONFIG_DIR, f), encoding="utf-8").read())
  raise ConfigError(f"config file {path!r} not found; presets in configs/: {', '.join(presets)}.")


def load_preset(spec: str, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """Loads `name[:arg]` from configs/ (used by `configs/base.py:tiny`)."""
  name, _, arg = spec.partition(":")
  return load(preset_path(name) + (f":{arg}" if arg else ""), overrides)


def load(path: str, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path[:arg]`, applies `overrides` ("a.b=value" strings) and returns a locked config."""
  file_path, _, arg = path.partition(":")
  module = _import_file(_resolve_path(file_path))
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{file_path} has no get_config(arg=None) function.")
  config = module.get_config(arg or None) if arg else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{file_path}: get_config returned {type(config).__name__}, not a ConfigDict.")
  config = ml_collections.ConfigDict(config.to_dict())  # an unlocked copy with the same types
  apply_overrides(config, overrides)
  config.lock()
  return config


def _all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for key, value in config.items():
    keys.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(_all_keys(value, prefix + key + "."))
  return keys


def _parse_value(text: str, current: Any, key: str) -> Any:
  """Parses an override string into the type of the field it replaces."""
  expected = type(current)
  if isinstance(current, bool):
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise ConfigError(f"{key} expects a bool (true/false), got {text!r}.")
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise ConfigError(f"{key} expects {expected.__name__}, got {text!r}.") from None
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"{key} expects a finite number, got {text!r}.")
  if current is not None and (type(value) is not expected):  # pylint: disable=unidiomatic-typecheck
    raise ConfigError(f"{key} expects {expected.__name__}, got {text!r} ({type(value).__name__}).")
  return value


def _closest_hint(key: str, valid: list[str]) -> str:
  """"; did you mean 'model.num_layers'?" -- first among the same section's keys."""
  section = key.rpartition(".")[0]
  siblings = [k for k in valid if k.rpartition(".")[0] == section]
  for pool in (siblings, valid):
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if close:
      return f"; did you mean {close[0]!r}?"
  if siblings:
    return f"; valid keys in {section or 'the top level'}: {', '.join(sorted(siblings))}"
  return ""


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
  """Applies "a.b=value" overrides in place; unknown keys and wrong types raise ConfigError."""
  valid = _all_keys(config)
  for override in overrides:
    key, sep, text = override.partition("=")
    key = key.strip()
    if key.startswith("config."):
      key = key[len("config."):]
    if not sep:
      raise ConfigError(f"override {override!r} is not of the form key=value.")
    if key not in valid:
      raise ConfigError(f"unknown config key {key!r}{_closest_hint(key, valid)}")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    current = node[leaf]
    if isinstance(current, ml_collections.ConfigDict):
      raise ConfigError(f"{key} is a section; override one of its fields, e.g. {key}.{next(iter(current))}.")
    node[leaf] = _parse_value(text, current, key)


def config_diff(config: ml_collections.ConfigDict, base: ml_collections.ConfigDict) -> dict[str, tuple]:
  """{key: (base value, value)} for every leaf that differs from `base` (or is absent there)."""
  def flat(c, prefix=""):
    out = {}
    for key, value in c.items():
      if isinstance(value, ml_collections.ConfigDict):
        out.update(flat(value, prefix + key + "."))
      else:
        out[prefix + key] = value
    return out
  mine, theirs = flat(config), flat(base)
  return {k: (theirs.get(k, "<absent>"), v) for k, v in mine.items() if theirs.get(k, "<absent>") != v}


def save_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes the resolved config as workdir/config.json and returns the path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  with open(path, "w") as f:
    json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  return path
