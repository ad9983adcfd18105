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

# gVisor (runsc) as an optional OCI runtime, where Debian ships it (ENVFLEET_NO_RUNSC=1 skips it). Registered in
# daemon.json with --network=none (sandboxes have no network; runsc's check for the root network namespace misfires
# on new kernels) and --host-uds=create (envd's socket in the bind-mounted directory must be reachable from the
# host). A running dockerd reloads its runtimes on SIGHUP: it is never restarted for this.
register_runsc() {
  [ "${ENVFLEET_NO_RUNSC:-0}" = 1 ] && return 0
  if ! command -v runsc >/dev/null 2>&1; then
    # grep reads all of it (no -q): stopping at the first match, it broke apt-cache's pipe, and with pipefail the
    # test was false nearly every time, so runsc was never installed and CI skipped the gVisor tests
    if apt-cache policy runsc 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null; then
      echo "ensure-docker: installing runsc (gVisor)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runsc >/dev/null || return 0
    else
      return 0
    fi
  fi
  local rc=0
  python3 - "$(command -v runsc)" <<'PY' || rc=$?
import json, os, sys
path = "/etc/docker/daemon.json"
conf = json.load(open(path)) if os.path.exists(path) else {}
want = {"path": sys.argv[1], "runtimeArgs": ["--network=none", "--host-uds=create"]}
if conf.get("runtimes", {}).get("runsc") == want:
    sys.exit(3)  # already registered: no reload
conf.setdefault("runtimes", {})["runsc"] = want
os.makedirs(os.path.dirname(path), exist_ok=True)
tmp = path + ".envfleet-tmp"
with open(tmp, "w") as f:
    json.dump(conf, f, indent=2)
os.replace(tmp, path)
print("ensure-docker: registered runsc in", path)
PY
  [ "$rc" = 0 ] || return 0
  # the running daemon by its pid file (pgrep may name several: a rootless one, another user's)
  local pid
  pid=$(cat /var/run/docker.pid 2>/dev/null || true)
  if [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null || true)" = dockerd ]; then kill -HUP "$pid" || true; fi
}
register_runsc

# Counts the kernel keeps for the whole host, raised where they are under what a host of the scheduler's default size
# needs (host_limit_warnings in orchestrator/backends/docker/backend.py): process ids (at 32,768, one tenant's
# sandboxes at their pids limit used them all, and then no process of the host could fork) and ptys (32 a sandbox)
raise_sysctl() {
  local path=/proc/sys/$1 want=$2 have
  have=$(cat "$path" 2>/dev/null) || return 0
  [ "$have" -lt "$want" ] || return 0
  if echo "$want" 2>/dev/null >"$path"; then
    echo "ensure-docker: $1 $have -> $want"
  else
    echo "ensure-docker: could not raise $1 from $have to $want" >&2
  fi
}
if [ "$(id -u)" = 0 ]; then
  raise_sysctl kernel/pid_max 4194304
  raise_sysctl kernel/pty/max 65536
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
  # its pid by name, as dockerd's: after a restore, a low pid is often some other process's
  if [ -z "$cpid" ] || [ "$(cat /proc/"$cpid"/comm 2>/dev/null || true)" != containerd ]; then
    rm -f /var/run/docker/containerd/containerd.pid
  fi
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
