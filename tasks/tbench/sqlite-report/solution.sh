#!/bin/bash
set -euo pipefail
sqlite3 /app/shop.db < /app/schema.sql
sqlite3 /app/shop.db "SELECT c.name FROM customers c JOIN orders o ON o.customer = c.id
  GROUP BY c.id ORDER BY SUM(o.total) DESC LIMIT 1;" > /app/top.txt
