"""Helpers the tests share (tests/ is on pytest's pythonpath: `from support import ...`)."""

import hashlib
import os


def folder_digests(folder: str) -> dict[str, str]:
  """{path: sha256 of its bytes} of every file under `folder`: equal before and after a refused run
  means nothing was written, changed or removed."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.join(root, name)] = hashlib.sha256(f.read()).hexdigest()
  return out
