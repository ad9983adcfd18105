#!/usr/bin/env bash
# Fails when any container made by envfleet is left on this machine (after the test suite, say).
set -euo pipefail
left=$(docker ps -aq --filter label=envfleet.managed=1)
if [ -n "$left" ]; then
  echo "LEAK: envfleet containers left behind:" >&2
  docker ps -a --filter label=envfleet.managed=1 --format '{{.ID}} {{.Names}} {{.Status}} {{.Labels}}' >&2
  docker rm -f $left >/dev/null || true
  exit 1
fi
echo "no envfleet container left behind"
