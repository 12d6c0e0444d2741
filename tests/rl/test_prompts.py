"""RL prompts through grain: the stream is the mixture in order (the demo's sequence), resumes at
exactly the next example, shards per host; JSONL and ArrayRecord rows are checked, bad ones skipped
and named by file and line; missing and empty files are refused by name."""

import json

import pytest

from meshrl import configs
from meshrl.rl.step import driver as loop
from meshrl.rl.envs import TaskMixture
from meshrl.rl.envs.prompts import ArrayRecordSource, JsonlSource, PromptStream

ROWS = ['{"prompt": "rev abc=", "answer": "cba", "domain": "reverse"}', '{"answer": "3"}', '',
        'not json', '{"prompt": "1+1=", "answer": 2}']


def _mixture():
  return TaskMixture("reverse:1.0,arithmetic:1.0", seed=3, split="train", eval_fraction=0.2)


def test_stream_is_the_mixture_in_order_and_resumes_at_the_next_example():
  mixture = _mixture()
  stream = PromptStream(mixture)
  first = [next(stream) for _ in range(7)]
  assert first == mixture.take(7)  # one host: the mixture in index order, as before grain
  state = stream.get_state()
  assert state == {"next_example": 7, "next_example_by_host": [7], "shard": [0, 1], "block": 1}
  following = [next(stream) for _ in range(3)]
  resumed = PromptStream(_mixture())
  resumed.set_state(json.loads(json.dumps(state)))  # through JSON, as in a checkpoint
  assert [next(resumed) for _ in range(3)] == following == mixture.take(3, start=7)
  assert PromptStream(mixture, position=7).position == 7


def test_hosts_read_disjoint_shards_and_resume_their_own():
  mixture = _mixture()
  host = PromptStream(mixture, shard=(1, 3), prefetch=0)
  assert [next(host) for _ in range(3)] == [mixture[1], mixture[4], mixture[7]]
  resumed = PromptStream(mixture, shard=(1, 3))
  resumed.set_state(host.get_state())
  assert next(resumed) == mixture[10]
  with pytest.raises(ValueError, match="saved by 3 hosts and this run has 2"):
    PromptStream(mixture, shard=(0, 2)).set_state(host.get_state())


_TWO_HOSTS = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from meshrl.rl.envs import TaskMixture
from meshrl.rl.envs.prompts import PromptStream
mixture = TaskMixture("reverse:1.0,arithmetic:1.0", seed=3, split="train", eval_fraction=0.2)
host = jax.process_index()
stream = PromptStream(mixture, shard=(host, 2), prefetch=0)
for _ in range(3 + 2 * host):  # the hosts draw different numbers of examples (e.g. rejected prompts)
  next(stream)
state = stream.get_state()  # collective: both hosts save together
print("STATE", json.dumps(state), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_save_every_hosts_position(tmp_path):
  """Two real jax processes (gloo collectives on CPU): the state a checkpoint keeps (process 0's) holds
  both hosts' positions, so host 1 resumes at its own next example, not host 0's."""
  import socket  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  script = tmp_path / "two_hosts.py"
  script.write_text(_TWO_HOSTS)
  env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  states = [json.loads(next(l for l in out.splitlines() if l.startswith("STATE"))[6:]) for out in outs]
  saved = states[0]  # what process 0 writes into the checkpoint
  assert saved["next_example_by_host"] == [3, 5]
  mixture = _mixture()
  resumed = PromptStream(mixture, shard=(1, 2), prefetch=0)
  resumed.set_state(saved)
  assert next(resumed) == mixture[1 + 2 * 5]  # host 1's sixth example


def test_host_blocks_side_by_side_are_the_one_process_batches():
  """Hosts drawing `block` prompts a step: their blocks, in host order, are the batch one process
  drawing 2 * block would get, step after step (so two processes train on what one would)."""
  mixture = _mixture()
  one = PromptStream(mixture, prefetch=0)
  two = [PromptStream(mixture, shard=(h, 2), block=3, prefetch=0) for h in range(2)]
  for _ in range(3):
    together = [next(two[h]) for h in range(2) for _ in range(3)]
    assert together == [next(one) for _ in range(6)]
  with pytest.raises(ValueError, match="blocks of 3 prompts per host and this run draws 2"):
    PromptStream(mixture, shard=(0, 2), block=2).set_state(two[0].get_state())


def _write_array_record(path, rows):
  # pylint: disable-next=import-outside-toplevel
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for row in rows:
    writer.write(row.encode("utf-8"))
  writer.close()


def test_file_sources_skip_malformed_rows_and_name_file_and_line(tmp_path):
  jsonl = tmp_path / "tasks.jsonl"
  jsonl.write_text("\n".join(ROWS) + "\n")
  source = JsonlSource(str(jsonl))
  assert len(source) == 2 and [e["prompt"] for e in source] == ["rev abc=", "1+1="]
  assert source[1]["answer"] == "2" and source[0]["verifier"]  # checked like load_jsonl's rows
  assert [(b.file, b.line) for b in source.bad] == [(str(jsonl), 2), (str(jsonl), 4)]
  assert "'prompt' is missing" in source.bad[0].reason
  records = tmp_path / "tasks.array_record"
  _write_array_record(records, [r for r in ROWS if r])
  packed = ArrayRecordSource(str(records))
  assert [e["prompt"] for e in packed] == ["rev abc=", "1+1="]
  assert [(b.file, b.line) for b in packed.bad] == [(str(records), 1), (str(records), 2)]
  with pytest.raises(ValueError, match=r"tasks.jsonl:2: malformed task row: 'prompt' is missing"):
    JsonlSource(str(jsonl), skip_bad=False)

  cfg = configs.load("configs/tiny.py", [f"data.jsonl={jsonl}", f"data.array_record={records}",
                                         "data.tasks=", "data.eval_fraction=0", "eval.every=0"])
  loop.check_config(cfg)
  mixture = loop.train_source(cfg)
  assert {e["prompt"] for e in mixture.take(40)} == {"rev abc=", "1+1="}
  assert loop.skipped_rows(mixture).startswith(f"skipped 4 malformed data rows ({jsonl}:2: ")
  stream = loop.prompt_stream(mixture)
  drawn = [next(stream) for _ in range(5)]
  again = loop.prompt_stream(loop.train_source(cfg))
  again.set_state(stream.get_state())
  assert drawn == mixture.take(5) and next(again) == mixture[5]


def test_missing_and_empty_data_files_are_refused_by_name(tmp_path):
  with pytest.raises(ValueError, match=r"data.array_record='/nonexistent.array_record': no such file"):
    loop.check_config(configs.load("configs/tiny.py", ["data.array_record=/nonexistent.array_record"]))
  with pytest.raises(ValueError, match=r"data.jsonl='/nonexistent.jsonl': no such file"):
    JsonlSource("/nonexistent.jsonl")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(ValueError, match=r"data.jsonl='.*empty.jsonl' holds no valid rows \(0 malformed\)"):
    JsonlSource(str(empty))
  bad = tmp_path / "bad.jsonl"
  bad.write_text("[1]\n")
  with pytest.raises(ValueError, match=r"holds no valid rows \(1 malformed; the first malformed: "
                     r".*bad.jsonl:1: row is a list"):
    loop.train_source(configs.load("configs/tiny.py", [f"data.jsonl={bad}", "data.tasks=",
                                                       "data.eval_fraction=0"]))
  records = tmp_path / "empty.array_record"
  _write_array_record(records, [])
  with pytest.raises(ValueError, match=r"data.array_record='.*empty.array_record' holds no valid rows"):
    ArrayRecordSource(str(records))
