"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import subprocess
import unittest


def git(*args):
  return subprocess.run(["git", "-C", "/app/project", *args], capture_output=True, text=True,
                        check=True).stdout


class TestRepository(unittest.TestCase):
  def test_one_commit(self):
    self.assertEqual(git("log", "--format=%an <%ae>|%s").splitlines(),
                     ["Meshrl Bot <bot@example.com>|initial import"])

  def test_all_files(self):
    self.assertEqual(sorted(git("ls-files").split()), ["README.md", "src/main.py"])
    self.assertEqual(git("status", "--porcelain"), "")
