#!/usr/bin/env bash
# Fails when a container made by envfleet is left on this machine (after the test suite, say), and removes it.
#   check-leaks.sh            every envfleet container counts
#   check-leaks.sh --list     prints the ids of the envfleet containers there now
#   check-leaks.sh BEFORE     the ids in file BEFORE (a --list taken before the run) are not the run's: a server
#                             running beside the tests keeps its sandboxes
set -euo pipefail
ids() { docker ps -aq --no-trunc --filter label=envfleet.managed=1; }
if [ "${1:-}" = "--list" ]; then
  ids
  exit 0
fi
left=$(ids)
if [ -n "${1:-}" ] && [ -s "$1" ]; then
  left=$(printf '%s\n' $left | grep -vxF -f "$1" || true)
fi
if [ -n "$left" ]; then
  echo "LEAK: envfleet containers left behind:" >&2
  for id in $left; do
    docker ps -a --filter "id=$id" --format '{{.ID}} {{.Names}} {{.Status}} {{.Labels}}' >&2
  done
  docker rm -f $left >/dev/null || true
  exit 1
fi
echo "no envfleet container left behind"
