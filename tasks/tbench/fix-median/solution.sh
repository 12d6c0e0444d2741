#!/bin/bash
set -euo pipefail
cat > /app/stats.py <<'EOF'
def median(values):
  ordered = sorted(values)
  middle = len(ordered) // 2
  if len(ordered) % 2:
    return ordered[middle]
  return (ordered[middle - 1] + ordered[middle]) / 2
EOF
