"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import unittest


class TestHello(unittest.TestCase):
  def test_content(self):
    with open("/app/hello.txt") as handle:
      self.assertEqual(handle.read().strip(), "Hello, world!")
