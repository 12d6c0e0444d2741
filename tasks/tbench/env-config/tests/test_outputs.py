"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import configparser
import unittest


class TestConfig(unittest.TestCase):
  def test_values(self):
    config = configparser.ConfigParser()
    self.assertEqual(config.read("/app/config.ini"), ["/app/config.ini"])
    self.assertEqual(dict(config["app"]), {"mode": "production", "port": "9090"})
