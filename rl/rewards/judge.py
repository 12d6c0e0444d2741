"""A generative judge as a batched reward source: a policy-shaped model reads a rubric with the prompt
and the policy's response, writes a verdict "Score: N", and N / max_score is the reward.

  rubrics = read_rubrics("writing=rubrics/writing.txt;*=rubrics/any.txt")   # {domain: Rubric}
  judge = Judge(model, tokenizer, rubrics, max_score=10, prompt_len=512, max_tokens=16, rows=R, mesh=mesh)
  scores, info = judge(completions, examples)       # [N] float32 in [0, 1]; info["judge_malformed"]

Decoding is the generation engine's (rl/generation: a `Generator` with a static scheduler, one slot
per sample, greedy), on the policy's mesh, R judge prompts per call (the last call padded by
repeating its first prompt), so one compiled program serves every step. With several host processes
each host judges its own samples, filling and reading its own R / processes rows of every call.

A rubric is text holding `{prompt}`, `{response}` and the verdict format `Score:`; the judge's
prompt is the rubric with the two filled in, rendered by the tokenizer's chat template, left-padded
to prompt_len tokens (a longer one keeps its last tokens and is counted in info["judge_truncated"]).

Verdicts are parsed by `parse_verdict`: the first "Score: N" (also "score = N", "Score: N/M" with M
the scale, "**Score:** N"); a verdict with none, a number outside [0, max_score] or another scale is
malformed: it scores 0 and is counted (info["judge_malformed"], and as a reward error with the
verdict's text), never guessed.

Axis legend: R judge prompts per call (a multiple of the mesh's batch shards), Lj prompt_len, Nj max_tokens.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from meshrl.model.tokenizer import Tokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.rewards.pool import Dispatched, call_rows
from meshrl.sharding import hosts
from meshrl.sharding.rules import TRAIN_RULES, logical_to_spec

FIELD = "rl.judge_rubrics"
SCORE_FORMAT = "Score:"
PLACEHOLDERS = ("{prompt}", "{response}")
DEFAULT = "*"
_VERDICT = re.compile(r"score\W{0,4}\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?",
                      re.IGNORECASE)


def parse_verdict(text: str, max_score: float) -> float | None:
  """The judge's score in [0, 1]: N / max_score of the first "Score: N" in `text`; None (malformed)
  when there is none, N lies outside [0, max_score], or "N/M" states a scale M != max_score."""
  match = _VERDICT.search(text)
  if match is None:
    return None
  value = float(match.group(1))
  if match.group(2) is not None and float(match.group(2)) != float(max_score):
    return None
  if not 0.0 <= value <= max_score:
    return None
  return value / float(max_score)


@dataclasses.dataclass(frozen=True)
class Rubric:
  """A judge prompt template; `where` names its file."""
  text: str
  where: str

  def render(self, prompt: str, response: str) -> str:
    # str.replace, not str.format: a rubric may hold braces of its own (JSON examples).
    return self.text.replace("{prompt}", prompt).replace("{response}", response)


def read_rubric(path: str, *, field: str = FIELD) -> Rubric:
  """The rubric in file `path`; ValueError naming `field` and the file when it is missing, or lacks
  a placeholder or the verdict format the parser reads."""
  if not os.path.isfile(path):
    raise ValueError(f"{field}: rubric file {path!r} does not exist.")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  missing = [p for p in PLACEHOLDERS if p not in text]
  if missing:
    raise ValueError(f"{field}: rubric {path!r} lacks {' and '.join(missing)}: the judge must see the prompt "
                     "and the response.")
  if SCORE_FORMAT.lower() not in text.lower():
    raise ValueError(f"{field}: rubric {path!r} has no score format: it must tell the judge to answer "
                     f"'{SCORE_FORMAT} N' (N from 0 to rl.judge_max_score), the verdict the parser reads.")
  return Rubric(text, path)


def read_rubrics(spec: str, *, field: str = FIELD) -> dict[str, Rubric]:
  """{domain: Rubric} from "domain=path;...;*=path" ("*": every other domain); ValueError naming
  `field` for a malformed item, a domain twice, or a bad rubric file."""
  rubrics = {}
  for item in (part.strip() for part in spec.split(";") if part.strip()):
    domain, eq, path = (s.strip() for s in item.partition("="))
    if not eq or not domain or not path:
      raise ValueError(f"{field}={spec!r}: item {item!r} must be 'domain=path' ('*=path' for every other domain).")
    if domain in rubrics:
      raise ValueError(f"{field}={spec!r} names domain {domain!r} twice.")
    rubrics[domain] = read_rubric(path, field=field)
  if not rubrics:
    raise ValueError(f"{field}={spec!r} names no rubric; the judge source needs one ('*=path' for every domain).")
  return rubrics


def rubric_for(rubrics: Mapping[str, Rubric], domain: str, *, field: str = FIELD) -> Rubric:
  """The rubric of `domain` (else the "*" one); ValueError naming `field` when neither exists."""
  rubric = rubrics.get(domain, rubrics.get(DEFAULT))
  if rubric is None:
    raise ValueError(f"{field}: no rubric for domain {domain!r} and no '*' rubric; add '{domain}=path' or '*=path'.")
  return rubric


def judge_spec(tokenizer: Tokenizer, *, prompt_len: int, max_tokens: int) -> GenerationSpec:
  """The judge's generation: greedy, one static slot per judge prompt, the tokenizer's stops."""
  step = StepConfig(sampler=Sampler(0.0), stop_tokens=tuple(tokenizer.stop_ids), pad_id=tokenizer.pad_id)
  return GenerationSpec(step=step, group_size=1, prompt_len=prompt_len, max_new_tokens=max_tokens)


class Judge:
  """Scores completions by a judge model's verdicts, decoded by the generation engine on `mesh`.

  Args:
    model: the judge (train/rm_source.load_judge_model), parameters sharded on `mesh`.
    mc: its model numbers with the generation rules (the KV cache dtype set).
    tokenizer: the policy's (checked to be the judge's by rm_source).
    rubrics: {domain: Rubric} ("*": every other domain).
    max_score: the scale's top; prompt_len, max_tokens: the judge's prompt and verdict tokens.
    rows: R judge prompts per call, a multiple of the mesh's batch shards and of the host processes.
    mesh, rules: the policy's mesh and its parameter rules (None: one device).
  """

  def __init__(self, model: nnx.Module, mc: ModelConfig, tokenizer: Tokenizer, rubrics: Mapping[str, Rubric], *,
               max_score: float, prompt_len: int, max_tokens: int, rows: int, mesh=None, rules=None):
    if not max_score > 0:
      raise ValueError(f"rl.judge_max_score={max_score} must be positive.")
    if rows < 1:
      raise ValueError(f"judge rows={rows} must be at least 1.")
    if prompt_len + max_tokens > mc.max_seq_len:
      raise ValueError(f"rl.judge_prompt_len={prompt_len} + rl.judge_max_tokens={max_tokens} exceeds the judge's "
                       f"model.max_seq_len={mc.max_seq_len}.")
    self.generator = Generator(judge_spec(tokenizer, prompt_len=prompt_len, max_tokens=max_tokens), mc, mesh=mesh,
                               rules=rules)
    _, self.params, self.extra = nnx.split(model, nnx.Param, ...)
    if rows % jax.process_count():
      raise ValueError(f"judge rows={rows} per call do not split over {jax.process_count()} host processes.")
    self.tokenizer, self.rubrics, self.max_score = tokenizer, dict(rubrics), float(max_score)
    self.prompt_len, self.rows = prompt_len, rows
    # [R, ...] prompts split by rows over the batch axes that divide R (as the rollout's prompts).
    self.prompt_sharding = None if mesh is None else NamedSharding(
        mesh, logical_to_spec(("batch",), TRAIN_RULES if rules is None else rules, mesh, shape=(rows,)))

  def prompts(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[list[str], int]:
    """(the judge's rendered prompts, how many are longer than prompt_len tokens)."""
    texts = [self.tokenizer.render_prompt(rubric_for(self.rubrics, str(e.get("domain", ""))).render(
        str(e["prompt"]), c)) for c, e in zip(completions, examples)]
    longer = sum(len(self.tokenizer.encode(t)) > self.prompt_len for t in texts)
    return texts, longer

  def _launch(self, texts: Sequence[str]) -> list:
    """Starts the judge's greedy decoding of each prompt text, R prompts per generation call, without
    waiting -> [(RolloutBatch on the devices, this host's prompts of the call that are real)]. With
    several host processes every call spans the mesh: each host fills its own R / processes prompts
    with its own texts (hosts.global_rows), and all make as many calls as the host with the most
    texts needs (hosts.calls_over_hosts; collective), a host with none included."""
    count = len(texts)
    per_call, num_calls = hosts.calls_over_hosts(count, self.rows)
    tokens, mask = self.tokenizer.encode_batch(list(texts) or [""], length=self.prompt_len, padding="left",
                                               overflow="truncate")
    calls = []
    for call in range(num_calls):
      index, real = call_rows(count, per_call, call)
      prompts, prompt_mask = (hosts.global_rows(x[index], self.prompt_sharding) for x in (tokens, mask))
      calls.append((self.generator(self.params, self.extra, prompts, prompt_mask, jax.random.key(0)), real))
    return calls

  def _read(self, calls: list) -> list[str]:
    """`_launch`'s calls -> this host's verdicts' texts (waits for them; with several host processes
    each reads its own rows of every call: hosts.share_to_host)."""
    out = []
    for batch, real in calls:
      response = hosts.share_to_host(batch.tokens)[:real, self.prompt_len:]
      keep = hosts.share_to_host(batch.response_mask)[:real, self.prompt_len:]
      out += self.tokenizer.decode_batch(np.where(keep, response, self.tokenizer.pad_id))
    return out

  def verdicts(self, texts: Sequence[str]) -> list[str]:
    """The judge's greedy verdict for each prompt text, R prompts per generation call."""
    return self._read(self._launch(texts))

  def dispatch(self, completions: Sequence[str], examples: Sequence[dict]) -> Dispatched:
    """Renders the judge's prompts and starts their decoding on the devices without waiting; `finish`
    parses the verdicts."""
    texts, longer = self.prompts(completions, examples)
    return Dispatched(self._launch(texts), list(completions), {"judge_truncated": longer})

  def finish(self, dispatched: Dispatched) -> tuple[np.ndarray, dict]:
    """-> (scores [N] float32 in [0, 1], info {"errors", "first_errors", "judge_malformed",
    "judge_truncated", "verdicts"}); a malformed verdict scores 0 and counts as an error."""
    verdicts = self._read(dispatched.calls)
    scores = np.zeros(len(verdicts), np.float32)
    malformed = []
    for i, verdict in enumerate(verdicts):
      value = parse_verdict(verdict, self.max_score)
      if value is None:
        malformed.append(f"judge[{i}]: malformed verdict {verdict[:60]!r}")
      else:
        scores[i] = value
    return scores, {"errors": len(malformed), "first_errors": malformed[:3], "judge_malformed": len(malformed),
                    **dispatched.info, "verdicts": verdicts}

  def __call__(self, completions: Sequence[str], examples: Sequence[dict]) -> tuple[np.ndarray, dict]:
    """`finish(dispatch(...))`: the scores at once."""
    return self.finish(self.dispatch(completions, examples))
