#!/bin/bash
set -euo pipefail
cd /app/project
git init -q
git add -A
git -c user.name='Meshrl Bot' -c user.email=bot@example.com commit -q -m 'initial import'
