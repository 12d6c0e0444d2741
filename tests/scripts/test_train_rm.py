"""scripts/train_rm.py: bad input is one line naming the file, line or field, with nothing written; a
short run from a preference file writes metrics with held-out accuracy and a checkpoint that loads
as a policy's reward model and exports to transformers' sequence-classification layout."""

import importlib.util
import json
import os

import pytest

from support import folder_digests
from meshrl import configs
from meshrl.configs import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RM = "--config=configs/tiny_rm.py"
GOOD = [{"prompt": f"rev {w}=", "chosen": w[::-1], "rejected": w} for w in
        ("abc", "dog", "owl", "cat", "sun", "map", "pen", "cup", "hat", "jam", "kit", "log")]


def _script_main(name):
  spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(REPO, "scripts", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def _main():
  return _script_main("train_rm")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  folder = tmp_path_factory.mktemp("rm_inputs")
  lines = {
      "good": [json.dumps(row) for row in GOOD],
      "missing_side": [json.dumps(GOOD[0]), json.dumps({"prompt": "rev abc=", "chosen": "cba"})],
      "empty_side": [json.dumps(GOOD[0]), json.dumps(GOOD[1]), json.dumps({**GOOD[2], "rejected": ""})],
      "not_json": [json.dumps(GOOD[0]), "{oops"],
      "long": [json.dumps(GOOD[0]), json.dumps({"prompt": "rev " + "a" * 60 + "=", "chosen": "x", "rejected": "y"})],
      "held_out": [json.dumps({"prompt": "rev zzz=", "chosen": "zzz", "rejected": "zz"})],
  }
  paths = {"folder": str(folder)}
  for name, rows in lines.items():
    (folder / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    paths[name] = str(folder / f"{name}.jsonl")
  return paths


CASES = [
    (["--config.rm.train_jsonl={missing_side}"], "{missing_side}:2: 'rejected' is missing"),
    (["--config.rm.train_jsonl={empty_side}"], "{empty_side}:3: 'rejected' is empty"),
    (["--config.rm.train_jsonl={not_json}"], "{not_json}:2: not JSON"),
    (["--config.rm.train_jsonl={long}", "--config.rm.eval_jsonl={held_out}"],
     "{long}:2: prompt + chosen is 68 tokens, longer than rm.max_len=32"),
    (["--config.rm.train_jsonl={good}", "--config.rm.eval_jsonl={good}"],
     "rm.eval_jsonl='{good}' shares 12 prompt(s) with rm.train_jsonl"),
    (["--config.rm.train_jsonl={folder}/nope.jsonl"], "rm.train_jsonl='{folder}/nope.jsonl': no such file"),
    (["--config.rm.overflow=drop"], "rm.overflow='drop' is not one of 'reject', 'truncate'"),
    (["--config.rm.negatives=on_policy"], "rm.negatives='on_policy' is not one of 'near_misses', 'policy_errors'"),
    (["--config.rm.pairs_from=on_policy"], "rm.pairs_from='on_policy' is not one of 'synthetic', 'policy', 'policy+synthetic'"),
    (["--config.rm.init=sft"], "rm.init='sft' is not one of 'model', 'policy'"),
    (["--config.rm.policy_samples=1"], "rm.policy_samples=1 must be at least 2"),
    (["--config.rm.policy_prompts=4"], "rm.policy_prompts=4 must be at least 8"),
    (["--config.rm.pairs_from=policy", "--config.rm.init=model", "--config.rl.sft_steps=0"],
     "rm.pairs_from='policy' samples the warm-started policy, but rl.sft_steps=0"),
    (["--config.rm.init=policy", "--config.rl.sft_steps=0"],
     "rm.init='policy' starts the reward model from the warm-started policy, but rl.sft_steps=0"),
    (["--config.rm.margin=-1.0"], "rm.margin=-1.0 must be at least 0.0"),
    (["--config.rm.max_len=100"], "rm.max_len=100 must lie in [0, model.max_seq_len=64]"),
    (["--config.rm.batch_size=3"], "rm.batch_size=3 is not divisible by the 8 batch shards"),
    (["--config.rm.learning_rate=0.0"], "rm.learning_rate=0.0 must be positive"),
    (["--config.data.eval_fraction=0.0"], "data.eval_fraction=0.0 holds out no prompts"),
]


@pytest.mark.parametrize("argv, fragment", CASES, ids=[c[1][:60] for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(inputs, argv, fragment, capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  argv = [RM, f"--workdir={inputs['folder']}/run"] + [a.format(**inputs) for a in argv]
  before = folder_digests(inputs["folder"])
  try:
    status = cli.run(_main(), argv)
  except SystemExit as exit_:
    status = exit_.code
  err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert status == 2, (status, err)
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert fragment.format(**inputs) in err[0], err[0]
  assert folder_digests(inputs["folder"]) == before


def test_a_short_run_writes_a_reward_model_that_loads_and_exports(inputs, tmp_path, monkeypatch, capsys):
  """3 steps from a preference file: metrics with held-out accuracy, a checkpoint that loads as a
  policy's reward model, and scripts/export_hf.py's sequence classifier scoring held-out rows as the
  meshrl checkpoint does (within 1e-4, through transformers)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from meshrl.model.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  from meshrl.train.preferences import encode_pairs, read_pairs  # pylint: disable=import-outside-toplevel
  from meshrl.train.reward_model import make_scorer  # pylint: disable=import-outside-toplevel
  from meshrl.train.rm_source import load_reward_model  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(REPO)
  workdir, out = str(tmp_path / "rm"), str(tmp_path / "hf")
  flags = [RM, "--config.model.qk_norm=true",  # Qwen3-MoE's attention, so the layout can hold it
           "--config.rm.pairs_from=synthetic", "--config.rm.init=model"]  # the file's pairs alone
  status = cli.run(_main(), flags + [f"--workdir={workdir}", f"--config.rm.train_jsonl={inputs['good']}",
                                     "--config.data.eval_fraction=0.3", "--config.rm.batch_size=8", "--steps=3",
                                     "--config.log.progress_bar=false", "--config.checkpoint.async_save=false"])
  printed, err = capsys.readouterr()
  assert status == 0, err
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert "eval/pairwise_accuracy" in records[0] and "eval/pairwise_accuracy" in records[-1]
  assert records[0]["eval/pairs"] + int(printed.split("pairs: ")[1].split()[0]) == len(GOOD)

  policy = configs.load("configs/tiny.py", ["model.qk_norm=True"])
  model, _ = load_reward_model(workdir, policy, None)
  arrays = encode_pairs(read_pairs(inputs["good"], field="f"), load_tokenizer(), max_len=32)
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  ours = np.asarray(make_scorer(graphdef)(params, extra, arrays.chosen, arrays.chosen_lengths))
  status = cli.run(_script_main("export_hf"), flags + ["--config.model.value_head=true",  # the RM's config
                                                       f"--checkpoint={workdir}", f"--out={out}",
                                                       "--architecture=Qwen3MoeForSequenceClassification"])
  assert status == 0, capsys.readouterr().err
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
      out, attn_implementation="eager", dtype=torch.float32).eval()
  assert hf.config.pad_token_id == load_tokenizer().pad_id
  with torch.no_grad():
    theirs = hf(torch.tensor(arrays.chosen, dtype=torch.long)).logits.numpy()[:, 0]
  assert np.abs(ours).max() > 1e-3
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
