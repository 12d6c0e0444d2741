"""scripts/resume_check.py end to end (slow: a reference run and a run killed and resumed)."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "scripts", "resume_check.py")


@pytest.mark.slow
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
  """4 SIGKILLs (2 while a checkpoint is written) on a short demo: every kill resumed, metrics and
  final arrays identical, no corrupt checkpoint. About 8 minutes on 2 cores; docs/benchmarks.md's figures
  come from the same script with --kills 20."""
  spec = importlib.util.spec_from_file_location("resume_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = tmp_path / "result.json"
  code = module.main(["--kills", "4", "--json", str(out), "--workdir", str(tmp_path / "work"),
                      "--override", "rl.num_steps=6", "--override", "rl.sft_steps=3"])
  result = json.loads(out.read_text())
  assert code == 0, result
  assert result["kills"] == result["resumed"] == 4 and result["corrupt_checkpoints"] == 0
  assert result["identical_metrics"] and result["identical_params"] and result["num_arrays"] > 10
  assert result["kills_during_save"] >= 1


def _module():
  spec = importlib.util.spec_from_file_location("resume_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("argv, fragment", [
    (["--override", "rl.num_step=3"], "unknown config key 'rl.num_step'; did you mean 'rl.num_steps'?"),
    (["--override", "optim.learning_rate=-1.0"], "optim.learning_rate=-1.0 must be positive"),
    (["--kills", "0"], "--kills=0 must be at least 1."),
    ([], "holds files this script did not make; give a new or empty folder"),
])
def test_bad_input_is_one_line_and_the_workdir_is_untouched(tmp_path, capsys, argv, fragment):
  """--workdir=DIR deleted DIR, whatever it held, and only then found a bad override."""
  from meshrl.configs import cli  # pylint: disable=import-outside-toplevel
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "thesis.tex").write_text("years of work")
  status = cli.run(_module().main, ["--json", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "work"), *argv])
  err = capsys.readouterr().err
  assert status == 2 and err.count("\n") == 1 and fragment in err, err
  assert (tmp_path / "work" / "thesis.tex").read_text() == "years of work"
  assert sorted(os.listdir(tmp_path)) == ["work"]


def test_only_a_scratch_folder_of_its_own_is_replaced(tmp_path):
  module = _module()
  module.fresh_scratch(str(tmp_path / "work"))
  (tmp_path / "work" / "reference.log").write_text("old run")
  module.fresh_scratch(str(tmp_path / "work"))  # marked as its own: replaced
  assert os.listdir(tmp_path / "work") == [module.MARKER]
