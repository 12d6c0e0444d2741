"""Writes docs/configuration.md, the reference of every config field, from configs/base.py.

  python scripts/config_reference.py                 # rewrites docs/configuration.md
  python scripts/config_reference.py --check         # exit 1 when the file is out of date

Each field's row is its dotted name, its default (from get_config()) and the comment on its line in
configs/base.py (with the comment lines that continue it); each section starts with the `# --- name:`
comment above it. The page is generated: edit base.py's comments, then run this script
(tests/test_docs.py fails when the two disagree).
"""

from __future__ import annotations

import ast
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.py")
OUT = os.path.join(REPO, "docs", "configuration.md")

HEADER = """# Configuration reference

Every field of a run, with its default and meaning: generated from the comments of
[`configs/base.py`](../configs/base.py) by `python scripts/config_reference.py` (do not edit this page;
edit the comments there and run the script: `tests/test_docs.py` checks the two agree).

A run is a preset (`--config=configs/tiny.py`, or `configs/base.py:tiny`) plus overrides
(`--config.rl.num_steps=200`); `python scripts/show_config.py --config=...` prints the resolved config
and its difference from base. A misspelt key or a value of the wrong type fails before anything runs,
naming the key; values out of range are refused by the run's checks (`rl/step/run_spec.check_config`,
`configs/checks.py`), one line naming the field.
"""


def _fields(source: str) -> list[tuple[str, str, str]]:
  """[(kind, name, text)]: ("section", name, comment) for each `# --- name: comment` line and
  ("field", dotted name, comment) for each `config.a.b = value  # comment` assignment, with the
  `#` lines right below it that continue the comment."""
  rows, lines = [], source.splitlines()
  assign = re.compile(r"^\s*config\.([\w.]+)\s*=\s*(.*)$")
  for index, line in enumerate(lines):
    section = re.match(r"^\s*# --- (\w+): (.*)$", line)
    if section:
      rows.append(("section", section.group(1), section.group(2).strip()))
      continue
    match = assign.match(line)
    if not match or "ConfigDict()" in match.group(2):
      continue
    code, _, comment = _split_comment(match.group(2))
    del code
    more = []
    for follow in lines[index + 1:]:
      stripped = follow.strip()
      if not stripped.startswith("#") or stripped.startswith("# ---"):
        break
      more.append(stripped.lstrip("#").strip())
    rows.append(("field", match.group(1), " ".join([comment.strip(), *more]).strip()))
  return rows


def _split_comment(text: str) -> tuple[str, str, str]:
  """(code, "#", comment) of the rest of an assignment line, ignoring '#' inside string literals."""
  for position, char in enumerate(text):
    if char == "#":
      try:
        ast.parse(text[:position].strip() or "None", mode="eval")
      except SyntaxError:
        continue
      return text[:position], "#", text[position + 1:]
  return text, "", ""


def _value(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def render() -> str:
  """The Markdown of docs/configuration.md."""
  sys.path.insert(0, os.path.dirname(REPO))
  from meshrl.configs import base  # pylint: disable=import-outside-toplevel
  config = base.get_config()
  with open(BASE, encoding="utf-8") as f:
    rows = _fields(f.read())
  out = [HEADER]
  in_table = False
  for kind, name, text in rows:
    if kind == "section":
      out.append(f"\n## `{name}`\n\n{text[:1].upper() + text[1:]}\n")
      in_table = False
      continue
    if not in_table:
      out.append("| field | default | meaning |\n|---|---|---|")
      in_table = True
    default = _value(config, name)
    out.append(f"| `{name}` | `{default!r}` | {_cell(text)} |")
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  from meshrl.configs import cli  # pylint: disable=import-outside-toplevel
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
  args = parser.parse_args(argv)
  text = render()
  if args.check:
    with open(OUT, encoding="utf-8") as f:
      if f.read() != text:
        print(f"error: {OUT} is out of date; run python scripts/config_reference.py", file=sys.stderr)
        return 1
    print(f"{OUT} is up to date")
    return 0
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {OUT}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
