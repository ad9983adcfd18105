#!/bin/sh
# Run the orchestrator image next to this host's Docker engine (README, "Deploy").
#
#   deploy/run.sh IMAGE [envfleet serve flags...]      e.g. deploy/run.sh envfleet/orchestrator:<tag of make image>
#
# Settings (environment of this script; defaults in brackets):
#   ENVFLEET_NAME         container name [envfleet-orchestrator]
#   ENVFLEET_PORT         gRPC port [50051]
#   ENVFLEET_SOCKET_ROOT  envd socket folders, the same absolute path on the host and inside
#                         [/run/envfleet-orchestrator]
#   ENVFLEET_DATA_VOLUME  named volume (or host folder) for the result log [envfleet-data]
#   ENVFLEET_TOKEN_FILE   host path of the tokens file (YAML token -> tenant); unset: no auth, loopback only
#   ENVFLEET_CONFIG       host path of a YAML or TOML file of serve options (deploy/envfleet.yaml)
#   ENVFLEET_NETWORK      host [host], or a docker network name: then the port is published and the server
#                         listens on 0.0.0.0, which needs TLS (ENVFLEET_TLS_CERT/KEY) or ENVFLEET_INSECURE=1
#   DOCKER_SOCK           the engine's socket [/var/run/docker.sock]
#   ENVFLEET_RESTART      the container's restart policy [unless-stopped]: a server that dies (a crash, an OOM kill)
#                         is started again by the engine, resumes its jobs from the data volume and sweeps the
#                         sandboxes it had; `no` leaves it down
#   ENVFLEET_TLS_DIR      host folder of PEM files, mounted read-only at /etc/envfleet/tls; name the files by their
#                         path inside: ENVFLEET_TLS_CERT, ENVFLEET_TLS_KEY (ENVFLEET_TLS_CLIENT_CA for mTLS), and for
#                         the health probe ENVFLEET_HEALTH_TLS_CA unless the certificate is self-signed
#                         (ENVFLEET_HEALTH_TLS_CERT/KEY under mTLS)
# Any other ENVFLEET_* variable set here is passed on (every `envfleet serve` flag has one: --max-in-flight is
# ENVFLEET_MAX_IN_FLIGHT).
#
# Run it as root (it mounts SOCKET_ROOT). The container can do whatever the engine can: access to the engine's
# socket is root on this host.
set -eu

IMAGE=${1:?usage: deploy/run.sh IMAGE [envfleet serve flags...]}
shift
NAME=${ENVFLEET_NAME:-envfleet-orchestrator}
DOCKER_SOCK=${DOCKER_SOCK:-/var/run/docker.sock}
SOCKET_ROOT=${ENVFLEET_SOCKET_ROOT:-/run/envfleet-orchestrator}
DATA_VOLUME=${ENVFLEET_DATA_VOLUME:-envfleet-data}
NETWORK=${ENVFLEET_NETWORK:-host}
RESTART=${ENVFLEET_RESTART:-unless-stopped}
export ENVFLEET_PORT="${ENVFLEET_PORT:-50051}" ENVFLEET_SOCKET_ROOT="$SOCKET_ROOT"

# Sandboxes are siblings: the engine bind-mounts their socket folders from the host's SOCKET_ROOT, which the server
# makes inside the container at the same path, each a 64 KiB tmpfs that it mounts (CAP_SYS_ADMIN) and hands to the
# sandbox's uid (root: chown). For the engine to see those mounts, SOCKET_ROOT is a shared mount point on the host
# and reaches the container with rshared propagation. The container has no AppArmor profile: Docker's default one
# (on Ubuntu and Debian hosts) denies every mount, so every sandbox's create would fail there.
install -d -m 0700 "$SOCKET_ROOT"
mountpoint -q "$SOCKET_ROOT" || mount --bind "$SOCKET_ROOT" "$SOCKET_ROOT"
mount --make-shared "$SOCKET_ROOT"

# The server runs as root in the container (for the chown and the mounts above) with the engine's socket: either
# alone is root on this host, so give the container to no one you would not give root.
# It runs in the host's pid namespace (and under the host's name): its sandboxes carry its pid, and a container
# started after it was killed (SIGKILL, an OOM, a stop past its grace) must see that pid gone to sweep them; in a
# namespace of its own each container was another host, whose sandboxes were kept until their lease (an hour at
# least), unless the kernel happened to hand the new namespace the old one's number.
# CAP_SYS_PTRACE (with CAP_SYS_ADMIN) lets it cap each sandbox's ptys through /proc/PID/root of the sandbox's envd, a
# process of another uid (orchestrator/backends/docker/ptys.py).
set -- --name "$NAME" --detach --init --stop-timeout 30 --restart "$RESTART" --pid host \
    --user 0:0 --cap-add SYS_ADMIN --cap-add SYS_PTRACE --security-opt apparmor=unconfined \
    --volume "$DOCKER_SOCK:/var/run/docker.sock" \
    --volume "$SOCKET_ROOT:$SOCKET_ROOT:rshared" \
    --volume "$DATA_VOLUME:/var/lib/envfleet" \
    "$IMAGE" serve "$@"
if [ "$NETWORK" = host ]; then
    set -- --network host "$@"
else
    export ENVFLEET_HOST="${ENVFLEET_HOST:-0.0.0.0}"
    set -- --network "$NETWORK" --publish "$ENVFLEET_PORT:$ENVFLEET_PORT" --hostname "$(hostname)" "$@"
fi
if [ -n "${ENVFLEET_TOKEN_FILE:-}" ]; then
    set -- --volume "$ENVFLEET_TOKEN_FILE:/etc/envfleet/tokens.yaml:ro" "$@"
    export ENVFLEET_TOKEN_FILE=/etc/envfleet/tokens.yaml
fi
if [ -n "${ENVFLEET_CONFIG:-}" ]; then
    conf="/etc/envfleet/config.${ENVFLEET_CONFIG##*.}"
    set -- --volume "$ENVFLEET_CONFIG:$conf:ro" "$@"
    export ENVFLEET_CONFIG="$conf"
fi
if [ -n "${ENVFLEET_TLS_DIR:-}" ]; then
    set -- --volume "$ENVFLEET_TLS_DIR:/etc/envfleet/tls:ro" "$@"
fi
# every ENVFLEET_* setting of this script's environment (by name only: docker reads the values from here)
for var in $(env | sed -n 's/^\(ENVFLEET_[A-Z0-9_]*\)=.*/\1/p'); do
    # this script's own settings; a client's token and a host cache path mean nothing inside
    case $var in
        ENVFLEET_NAME | ENVFLEET_DATA_VOLUME | ENVFLEET_NETWORK | ENVFLEET_RESTART | ENVFLEET_TLS_DIR | ENVFLEET_TOKEN | \
            ENVFLEET_CACHE)
            continue ;;
    esac
    set -- --env "$var" "$@"
done
exec docker run "$@"
