"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import unittest


class TestTotal(unittest.TestCase):
  def test_total(self):
    with open("/app/total.txt") as handle:
      self.assertEqual(handle.read().strip(), "57.50")
