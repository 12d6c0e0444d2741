"""rl/envs/quality.py: the quality gate quarantines every planted fault and no sound task; the
quarantine list is append-only and fed by environment failures seen in training."""

import json

import pytest

from meshrl.rl.envs import terminal_tasks
from meshrl.rl.envs.quality import Quarantine, judge, run_gate
from meshrl.rl.envs.terminal import StepOutcome, load_task


def _outcome(exit_code=0, timed_out=False):
  return StepOutcome(exit_code=None if timed_out else exit_code, signal=None, timed_out=timed_out,
                     output=b"", truncated=False, seconds=0.0)


def test_judge_names_each_fault(tmp_path):
  meta, spec = terminal_tasks.make_task("create", 0)
  terminal_tasks.write_task(str(tmp_path / "t"), meta, spec)
  task = load_task(str(tmp_path / "t"))
  labels = ["oracle0", "check_oracle0", "check_oracle0", "oracle1", "check_oracle1", "check_empty",
            "check_empty"]
  sound = [_outcome(0), _outcome(0), _outcome(0), _outcome(0), _outcome(0), _outcome(1), _outcome(1)]
  assert judge(task, labels, sound, k=2) == []
  def with_(i, outcome):
    return sound[:i] + [outcome] + sound[i + 1:]
  assert "flaky" in judge(task, labels, with_(2, _outcome(1)), k=2)[0]
  assert "flaky" in judge(task, labels, with_(6, _outcome(0)), k=2)[0]
  assert "1 of 2 runs" in judge(task, labels, with_(4, _outcome(1)), k=2)[0]
  assert "oracle.sh fails itself" in judge(task, labels, with_(3, _outcome(2)), k=2)[0]
  assert "crashed" in judge(task, labels, with_(5, _outcome(127)), k=2)[0]
  assert "did not finish" in judge(task, labels[:1], [_outcome(timed_out=True)], k=2)[0]
  empty_pass = sound[:5] + [_outcome(0), _outcome(0)]
  assert judge(task, labels, empty_pass, k=2) == [
      "check.sh passes on the empty work directory (setup only)"]


@pytest.mark.needs_sandbox
def test_gate_quarantines_every_planted_fault_and_no_sound_task(tmp_path):
  faults = terminal_tasks.write_planted_faults(str(tmp_path / "faults"))
  sound = terminal_tasks.write_tasks(str(tmp_path / "sound"), per_family=1, seed=3)
  assert len(set(faults.values())) >= 12
  quarantine = Quarantine(str(tmp_path / "q.jsonl"))
  report = run_gate([str(tmp_path / "sound"), str(tmp_path / "faults")], quarantine=quarantine)
  fault_ids = {f"fault-{kind}" if f"fault-{kind}" in report["reasons"] else folder
               for folder, kind in faults.items()}
  assert set(report["quarantined"]) == fault_ids, report["reasons"]
  assert not set(sound) & set(report["quarantined"])
  assert report["tasks"] == len(faults) + len(sound)
  assert quarantine.ids == frozenset(report["quarantined"])
  assert {json.loads(line)["id"] for line in open(tmp_path / "q.jsonl")} == quarantine.ids
  assert "empty work directory" in report["reasons"]["fault-empty_passes"]
  assert "timeout_s=1" in report["reasons"]["fault-oracle_timeout"]


@pytest.mark.needs_sandbox
@pytest.mark.slow
def test_gate_over_all_generated_tasks(tmp_path):
  names = terminal_tasks.write_tasks(str(tmp_path / "tasks"))
  assert len(names) >= 60 and len({n.split("-")[0] for n in names}) == 6
  report = run_gate([str(tmp_path / "tasks")])
  assert report["quarantined"] == [], report["reasons"]


@pytest.mark.needs_sandbox
def test_policy_flags_curriculum(tmp_path):
  terminal_tasks.write_tasks(str(tmp_path / "t"), per_family=1, families=("create", "find"))
  report = run_gate([str(tmp_path / "t")], k=1, repeats=2, samples=2, policy=lambda c: "<done>")
  assert report["curriculum"] == {"create-0-000": "never_solved", "find-0-000": "never_solved"}


def test_quarantine_file_is_append_only_and_fed_by_failures(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text('{"id": "old", "reason": "qa"}\n')
  quarantine = Quarantine(str(path), threshold=2)
  assert "old" in quarantine and quarantine.add("new", "broken")
  assert not quarantine.add("new", "again")
  assert not quarantine.record_failure({"task_id": "t1"}, "sandbox timeout")
  assert quarantine.record_failure({"task_id": "t1"}, "checker crashed")
  assert "t1" in quarantine and "checker crashed" in quarantine.reasons["t1"]
  assert [json.loads(l)["id"] for l in path.read_text().splitlines()] == ["old", "new", "t1"]
  assert Quarantine(str(path)).ids == {"old", "new", "t1"}
  path.write_text("not json\n")
  with pytest.raises(ValueError, match="q.jsonl:1"):
    Quarantine(str(path))


def test_dataset_gate_flags_wrong_references_permissive_verifiers_and_duplicates(tmp_path):
  """JSONL rows: a reference its verifier rejects, a verifier that passes a blank answer, a duplicate
  prompt, a verifier that raises and a malformed line are each flagged; sound rows are not; flagged
  rows with ids join the quarantine."""
  from meshrl.rl.envs.dataset_gate import gate_jsonl  # pylint: disable=import-outside-toplevel
  rows = [{"id": "ok", "prompt": "2+2=", "answer": "4", "verifier": "numeric"},
          {"id": "ok2", "prompt": "reverse abc", "answer": "cba", "verifier": "exact"},
          {"id": "wrong_ref", "prompt": "countdown", "answer": "1+1", "verifier": "countdown",
           "numbers": [3, 5], "target": 8},
          {"id": "dupe", "prompt": " 2+2= ", "answer": "4", "verifier": "numeric"},
          {"id": "crash", "prompt": "x", "answer": "1", "verifier": "nope"}]
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json}\n"
                  + json.dumps({"prompt": "3+3=", "answer": "6"}) + "\n")
  quarantine = Quarantine(str(tmp_path / "q.jsonl"))
  report = gate_jsonl(str(path), quarantine=quarantine, workers=1)
  assert report["rows"] == 7
  assert sorted(report["quarantined"]) == ["crash", "dupe", "line 6", "wrong_ref"], report["reasons"]
  assert report["reasons"]["dupe"] == "duplicate prompt of ok"
  assert "the reference answer scores 0" in report["reasons"]["wrong_ref"]
  assert "verifier 'nope' raised" in report["reasons"]["crash"]
  assert report["reasons"]["line 6"].startswith("malformed row")
  assert quarantine.ids == {"crash", "dupe", "wrong_ref"}  # "line 6" has no id to name it by


def test_dataset_gate_catches_a_verifier_that_passes_anything():
  from meshrl.rl.envs.dataset_gate import check_examples  # pylint: disable=import-outside-toplevel
  lenient = check_examples([{"prompt": "p", "answer": "a"}], ["p"], reward=lambda c, e: 1.0)
  assert lenient["reasons"] == {"p": "a blank answer scores 1 by verifier 'default' (must be 0)"}


@pytest.mark.needs_sandbox
def test_dataset_gate_checks_code_tasks_by_their_own_tests():
  import numpy as np  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.dataset_gate import check_examples  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.mixture import make_example  # pylint: disable=import-outside-toplevel
  examples = [make_example("code", np.random.default_rng(i), difficulty=1) for i in range(3)]
  broken = dict(examples[1], answer=examples[1]["answer"].replace("return", "return None and"))
  report = check_examples(examples + [broken], ["c0", "c1", "c2", "c1-broken"])
  assert report["quarantined"] == ["c1-broken"], report["reasons"]
  assert "the reference answer scores 0 by verifier 'code'" in report["reasons"]["c1-broken"]
