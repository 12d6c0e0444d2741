#!/bin/bash
set -euo pipefail
cd /app/photos
for f in *.jpeg; do mv -- "$f" "${f%.jpeg}.jpg"; done
