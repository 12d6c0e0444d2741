"""User tasks from a JSONL file: one {"prompt", "answer", "domain"?, ...} object per line."""

from __future__ import annotations

import json
from typing import NamedTuple

from meshrl.rl.envs.mixture import DOMAINS


class JsonlExamples(NamedTuple):
  examples: list[dict]  # the valid rows, in file order
  num_bad: int  # malformed rows skipped
  bad_lines: list[int]  # their 1-based line numbers


def check_row(row) -> dict:
  """The example of one parsed row (a JSONL line or an ArrayRecord record); ValueError saying what
  is wrong."""
  if not isinstance(row, dict):
    raise ValueError(f"row is a {type(row).__name__}, not an object")
  prompt = row.get("prompt")
  if not isinstance(prompt, str) or not prompt:
    raise ValueError("'prompt' is missing or not a non-empty string")
  answer = row.get("answer")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError("'answer' is missing or not a string or number")
  domain = row.get("domain", "jsonl")
  if not isinstance(domain, str):
    raise ValueError("'domain' is not a string")
  example = {**row, "prompt": prompt, "answer": str(answer), "domain": domain}
  if "verifier" not in example and domain in DOMAINS:
    example["verifier"] = DOMAINS[domain].verifier
  return example


def load_jsonl(path: str, *, skip_bad: bool = True) -> JsonlExamples:
  """Reads examples; blank lines are ignored, malformed rows are skipped and counted.

  A row is malformed when it is not a JSON object, lacks a non-empty string "prompt", or lacks an
  "answer" string or number (numbers become strings). A missing "domain" becomes "jsonl"; a known
  domain without "verifier" gets the domain's default verifier.

  Args:
    path: the JSONL file.
    skip_bad: skip malformed rows (True) or raise on the first (False).

  Raises:
    ValueError naming the file and 1-based line number of a malformed row, when skip_bad=False.
  """
  examples, bad_lines = [], []
  with open(path, encoding="utf-8") as file:
    for line_number, line in enumerate(file, start=1):
      if not line.strip():
        continue
      try:
        examples.append(check_row(json.loads(line)))
      except ValueError as error:  # json.JSONDecodeError is a ValueError too.
        if not skip_bad:
          raise ValueError(f"{path}:{line_number}: malformed task row: {error}") from None
        bad_lines.append(line_number)
  return JsonlExamples(examples, len(bad_lines), bad_lines)
