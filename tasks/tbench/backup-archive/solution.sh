#!/bin/bash
set -euo pipefail
tar -czf /app/backup.tar.gz --exclude='*.tmp' -C /app data
