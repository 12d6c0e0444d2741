#!/bin/bash
set -euo pipefail
{
  echo service,errors
  for f in logs/*.log; do
    echo "$(basename "$f" .log),$(grep -c '^ERROR' "$f")"
  done | sort -t, -k2,2nr -k1,1
} > errors.csv
