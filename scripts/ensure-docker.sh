#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine: install docker.io and debootstrap when they are missing, and
# start dockerd (no bridge, no iptables: sandboxes get no network) when it is not running.
set -euo pipefail

log=${ENVFLEET_DOCKERD_LOG:-/var/log/envfleet-dockerd.log}

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "ensure-docker: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if timeout 10 docker info >/dev/null 2>&1; then
  exit 0
fi

# A killed dockerd leaves its pid file behind, and a new one refuses to start while it exists.
pidfile=/var/run/docker.pid
if [ -f "$pidfile" ]; then
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null || true)" = dockerd ]; then
    echo "ensure-docker: dockerd (pid $pid) is running but not answering yet"
  else
    echo "ensure-docker: removing stale $pidfile (pid ${pid:-?} is not a live dockerd)"
    rm -f "$pidfile"
  fi
fi
# containerd leaves a pid file of its own
if [ -f /var/run/docker/containerd/containerd.pid ]; then
  cpid=$(cat /var/run/docker/containerd/containerd.pid 2>/dev/null || true)
  if [ -z "$cpid" ] || [ ! -d /proc/"$cpid" ]; then rm -f /var/run/docker/containerd/containerd.pid; fi
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
  echo "ensure-docker: starting dockerd (log: $log)"
  mkdir -p "$(dirname "$log")"
  nohup setsid dockerd --bridge=none --iptables=false --ip6tables=false >>"$log" 2>&1 </dev/null &
fi

for _ in $(seq 1 120); do
  if timeout 5 docker info >/dev/null 2>&1; then
    exit 0
  fi
  sleep 0.5
done
echo "ensure-docker: dockerd did not answer within 60 s; last log lines:" >&2
tail -n 20 "$log" >&2 || true
exit 1
