"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import unittest
import urllib.request


class TestServer(unittest.TestCase):
  def test_index(self):
    with urllib.request.urlopen("http://127.0.0.1:8000/index.html", timeout=5) as reply:
      self.assertIn(b"meshrl served me", reply.read())
