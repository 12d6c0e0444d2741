"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import unittest


class TestActive(unittest.TestCase):
  def test_names(self):
    with open("/app/active.txt") as handle:
      self.assertEqual(handle.read().split(), ["ben", "mira", "zoe"])
