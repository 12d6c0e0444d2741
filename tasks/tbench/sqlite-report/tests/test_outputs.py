"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import sqlite3
import unittest


class TestReport(unittest.TestCase):
  def test_database_loaded(self):
    with sqlite3.connect("file:/app/shop.db?mode=ro", uri=True) as db:
      self.assertEqual(db.execute("SELECT COUNT(*) FROM orders").fetchone(), (5,))

  def test_top(self):
    with open("/app/top.txt") as handle:
      self.assertEqual(handle.read().strip(), "ada")
