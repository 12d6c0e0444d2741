"""The task's tests (unittest; run by run-tests.sh with $TEST_DIR holding them)."""

import tarfile
import unittest


class TestArchive(unittest.TestCase):
  def test_members(self):
    with tarfile.open("/app/backup.tar.gz", "r:gz") as archive:
      files = sorted(m.name for m in archive.getmembers() if m.isfile())
      self.assertEqual(files, ["data/img/logo.svg", "data/report.txt"])
      self.assertEqual(archive.extractfile("data/report.txt").read(), b"quarterly report\n")
