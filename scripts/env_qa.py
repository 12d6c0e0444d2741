"""The environment quality gate over terminal task directories (rl/envs/quality.py).

  python scripts/env_qa.py --tasks DIR [DIR ...] --json report.json [--quarantine q.jsonl] \
      [--k 3] [--repeats 5] [--workers 2] [--samples 4] [--runtime build|host] [--jsonl FILE ...] \
      [--policy module:factory | --checkpoint CKPT --config PRESET [--config.a.b=v ...]]

Each DIR is a task directory or a folder of them (terminal tasks, or Terminal-Bench tasks whose
runtimes --runtime builds or takes from the host, rl/envs/tbench.py). --jsonl gates single-turn
datasets too (rl/envs/dataset_gate.py: the reference answer passes its own verifier, a blank answer
fails, no duplicate prompts), reported under "datasets" {file: report}. Writes {"tasks": n, "quarantined": [ids],
"reasons": {id: reason}, "curriculum": {id: flag}, "seconds": {...}, "wall_s": s} (with --checkpoint
also "policy": {"calls", "generated_tokens", "context_full"}) to --json and
appends the quarantined ids to the quarantine list (default: quarantine.jsonl beside the JSON), the
file data.quarantine points training at. A policy plays --samples episodes of every sound task and
flags the tasks it always or never solves ("curriculum"): --policy names a factory
`() -> generate(conversation)`; --checkpoint is a meshrl checkpoint (a step folder, checkpoints/ or a
work dir) of the model of --config (preset and overrides, as scripts/rl.py takes them), loaded onto one
device and decoded by serve/engine.py's Engine at rl.temperature (0 = greedy), rl.max_turn_tokens
tokens per turn, its conversation rendered as rl/step/episodes.py renders an episode. Exit status 0 even
when tasks are quarantined; 2 for bad flags.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from meshrl.configs import cli
from meshrl.rl.envs.quality import Quarantine, run_gate


def _policy(spec: str):
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"--policy={spec!r} must be module:factory")
  return getattr(importlib.import_module(module), name)()


def render_conversation(tokenizer, conversation) -> str:
  """An episode's messages as the policy reads them in rl/step/episodes.py: the task as the rendered
  prompt, then the policy's turns as generated and each observation between `<out>` tags."""
  from meshrl.rl.step.episodes import render_observation  # pylint: disable=import-outside-toplevel
  if not conversation or conversation[0]["role"] != "user":
    raise ValueError("a conversation starts with the task's user message")
  parts = [tokenizer.render_prompt(conversation[0]["content"])]
  for message in conversation[1:]:
    content = message["content"]
    parts.append(render_observation(content) if message["role"] == "tool" else content)
  return "".join(parts)


def cut_turn(text: str) -> str:
  """The turn up to and including its first stop string (`</cmd>`, `<done>`), as the multi-turn
  rollout's decode ends it; the whole text when there is none."""
  from meshrl.rl.envs.base import STOP_STRINGS  # pylint: disable=import-outside-toplevel
  ends = [text.index(s) + len(s) for s in STOP_STRINGS if s in text]
  return text[:min(ends)] if ends else text


class CheckpointPolicy:
  """`generate(conversation) -> turn text` of a meshrl checkpoint on one device (see the docstring).

  Every call submits the rendered conversation to one shared Engine (calls from the gate's worker
  threads decode together in its slots; a later turn reuses the earlier turns' prefix cache) with its
  own seed, so repeated episodes of a task differ at temperature > 0."""

  def __init__(self, cfg, checkpoint: str):
    # pylint: disable=import-outside-toplevel  (jax only when a checkpoint is asked for)
    import itertools

    import jax
    from flax import nnx

    from meshrl.model.tokenizer import tokenizer_from_config
    from meshrl.model.transformer import Transformer
    from meshrl.serve.engine import Engine, EngineSpec
    from meshrl.train.checkpoint import from_nested_dict, load_params
    from meshrl.train.init_from import model_config
    # pylint: enable=import-outside-toplevel
    self.tokenizer = tokenizer_from_config(cfg)
    spec = EngineSpec.from_config(cfg)
    mc = model_config(cfg)
    graphdef, like, rest = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
    parts = ("params", "extra") if jax.tree.leaves(rest) else ("params",)  # router biases, if any
    saved = load_params(checkpoint, parts=parts)
    try:
      params = from_nested_dict(saved["params"], like)
      extra = from_nested_dict(saved["extra"], rest) if "extra" in saved else rest
    except KeyError as missing:
      raise ValueError(f"the checkpoint has no parameter {missing} of the --config model") from None
    wrong = [f"{jax.tree_util.keystr(path)}: saved {got.shape}, --config {want.shape}" for (path, got), want in
             zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(like)) if got.shape != want.shape]
    if wrong:
      raise ValueError(f"the checkpoint is not of the --config model: {'; '.join(wrong[:4])}")
    self.engine = Engine(nnx.merge(graphdef, params, extra), spec, stop_ids=self.tokenizer.stop_ids,
                         pad_id=self.tokenizer.pad_id).start()
    self.max_len, self.turn_tokens = spec.max_len, cfg.rl.max_turn_tokens
    self.temperature = float(cfg.rl.temperature)
    self._seeds = itertools.count(cfg.seed)
    self.stats = {"calls": 0, "generated_tokens": 0, "context_full": 0}  # the report's "policy"

  def __call__(self, conversation) -> str:
    from meshrl.rl.envs.base import DONE  # pylint: disable=import-outside-toplevel
    ids = self.tokenizer.encode(render_conversation(self.tokenizer, conversation))
    room = min(self.turn_tokens, self.max_len - len(ids))
    self.stats["calls"] += 1
    if room < 1:  # the context is full: end the episode (it is still graded), as the rollout does
      self.stats["context_full"] += 1
      return DONE
    out, _ = self.engine.generate(ids, room, temperature=self.temperature, seed=next(self._seeds))
    self.stats["generated_tokens"] += len(out)
    return cut_turn(self.tokenizer.decode(out))

  def close(self) -> None:
    self.engine.close()


def main(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", nargs="+", default=[])
  parser.add_argument("--jsonl", nargs="+", default=[], help="JSONL datasets to gate")
  parser.add_argument("--runtime", choices=("build", "host"), default="build",
                      help="how Terminal-Bench tasks get their runtime")
  parser.add_argument("--json", required=True)
  parser.add_argument("--quarantine", default="")
  parser.add_argument("--k", type=int, default=3, help="oracle runs that must all pass")
  parser.add_argument("--repeats", type=int, default=5, help="repeated checks that must agree")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--policy", default="", help="module:factory of a generate(conversation) policy")
  parser.add_argument("--checkpoint", default="", help="meshrl checkpoint of the --config model")
  parser.add_argument("--config", default="", help="the checkpoint's preset, e.g. configs/tiny.py[:ARG]")
  parser.add_argument("--samples", type=int, default=4, help="policy episodes per task")
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
  args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
  if not args.tasks and not args.jsonl:
    parser.error("give --tasks (task directories) and/or --jsonl (datasets)")
  for path in args.tasks:
    if not os.path.isdir(path):
      parser.error(f"--tasks {path!r}: no such directory")
  for path in args.jsonl:
    if not os.path.isfile(path):
      parser.error(f"--jsonl {path!r}: no such file")
  if args.k < 1 or args.repeats < 2 or args.workers < 1 or args.samples < 1:
    parser.error("--k, --workers and --samples must be >= 1 and --repeats >= 2")
  if args.policy and args.checkpoint:
    parser.error("--policy and --checkpoint both name the policy: give one")
  if bool(args.checkpoint) != bool(args.config) or (overrides and not args.checkpoint):
    parser.error("--checkpoint needs --config (the checkpoint's preset), and --config / --config.* "
                 "overrides need --checkpoint")
  if args.checkpoint and not os.path.isdir(args.checkpoint):
    parser.error(f"--checkpoint {args.checkpoint!r}: no such directory")
  try:
    if args.checkpoint:
      from meshrl.configs.loader import ConfigError, load  # pylint: disable=import-outside-toplevel
      from meshrl.train.checkpoint import CheckpointError  # pylint: disable=import-outside-toplevel
      try:
        policy = CheckpointPolicy(load(args.config, overrides), args.checkpoint)
      except (ConfigError, CheckpointError) as error:
        raise ValueError(f"--checkpoint {args.checkpoint} --config {args.config}: {error}") from None
    else:
      policy = _policy(args.policy) if args.policy else None
  except (ValueError, ImportError, AttributeError) as error:
    parser.error(str(error))
  quarantine_path = args.quarantine or os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                                    "quarantine.jsonl")
  started = time.monotonic()
  quarantine = Quarantine(quarantine_path)
  try:
    report = (run_gate(args.tasks, k=args.k, repeats=args.repeats, workers=args.workers, policy=policy,
                       samples=args.samples, quarantine=quarantine, runtime=args.runtime)
              if args.tasks else {"tasks": 0, "quarantined": [], "reasons": {}, "curriculum": {},
                                  "seconds": {}})
  finally:
    if hasattr(policy, "close"):
      policy.close()
  if args.jsonl:
    from meshrl.rl.envs.dataset_gate import gate_jsonl  # pylint: disable=import-outside-toplevel
    report["datasets"] = {path: gate_jsonl(path, quarantine=quarantine, workers=args.workers)
                          for path in args.jsonl}
  report["wall_s"] = round(time.monotonic() - started, 2)
  if isinstance(policy, CheckpointPolicy):
    report["policy"] = dict(policy.stats)
  report["quarantine_file"] = quarantine_path
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  for task_id in report["quarantined"]:
    print(f"QUARANTINED {task_id}: {report['reasons'][task_id][:150]}")
  for task_id, flag in sorted(report["curriculum"].items()):
    print(f"curriculum {task_id}: {flag}")
  for path, dataset in report.get("datasets", {}).items():
    print(f"{path}: {dataset['rows']} rows, {len(dataset['quarantined'])} flagged")
    for row_id in dataset["quarantined"][:20]:
      print(f"  FLAGGED {row_id}: {dataset['reasons'][row_id][:150]}")
  print(f"{report['tasks']} tasks, {len(report['quarantined'])} quarantined, "
        f"{report['wall_s']} s; report {args.json}, quarantine list {quarantine_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
