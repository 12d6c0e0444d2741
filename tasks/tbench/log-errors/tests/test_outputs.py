"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import unittest


class TestErrors(unittest.TestCase):
  def test_table(self):
    with open("/app/errors.csv") as handle:
      self.assertEqual(handle.read().split(), ["service,errors", "web,3", "api,2", "db,1"])
