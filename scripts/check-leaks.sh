#!/usr/bin/env bash
# Fails when a container made by envfleet is left on this machine (after the test suite, say), and removes it.
#   check-leaks.sh            every envfleet container counts
#   check-leaks.sh --list     prints "ID OWNER" of each envfleet container there now
#   check-leaks.sh BEFORE     a --list taken before the run: its containers, and any other of their owners (a server
#                             running beside the run makes and removes sandboxes meanwhile), are not the run's
set -euo pipefail
list() { docker ps -a --no-trunc --filter label=envfleet.managed=1 --format '{{.ID}} {{.Label "envfleet.owner"}}'; }
if [ "${1:-}" = "--list" ]; then
  list
  exit 0
fi
before="${1:-/dev/null}"
left=$(list | awk -v before="$before" '
  BEGIN { while ((getline line < before) > 0) { split(line, f, " "); seen[f[1]] = 1; if (f[2] != "") owner[f[2]] = 1 } }
  !($1 in seen) && ($2 == "" || !($2 in owner)) { print $1 }')
if [ -n "$left" ]; then
  echo "LEAK: envfleet containers left behind:" >&2
  for id in $left; do
    docker ps -a --filter "id=$id" --format '{{.ID}} {{.Names}} {{.Status}} {{.Labels}}' >&2
  done
  docker rm -f $left >/dev/null || true
  exit 1
fi
echo "no envfleet container left behind"
