"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import os
import unittest


class TestRenamed(unittest.TestCase):
  def test_names_and_contents(self):
    names = sorted(os.listdir("/app/photos"))
    self.assertEqual(names, ["beach.jpg", "city.jpg", "forest.jpg", "notes.txt"])
    for name in ("beach", "city", "forest"):
      with open(f"/app/photos/{name}.jpg") as handle:
        self.assertEqual(handle.read(), f"fake image {name}\n")
