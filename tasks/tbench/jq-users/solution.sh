#!/bin/bash
set -euo pipefail
jq -r '.[] | select(.active) | .name' users.json | sort > active.txt
