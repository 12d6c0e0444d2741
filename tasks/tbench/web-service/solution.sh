#!/bin/bash
set -euo pipefail
nohup python3 -m http.server 8000 --bind 127.0.0.1 --directory /app/www > /tmp/server.log 2>&1 &
for _ in $(seq 50); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', 8000), timeout=1)" 2>/dev/null && break
  sleep 0.1
done
