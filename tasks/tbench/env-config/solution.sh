#!/bin/bash
set -euo pipefail
printf '[app]\nmode = %s\nport = %s\n' "$APP_MODE" "$APP_PORT" > /app/config.ini
