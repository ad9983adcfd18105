#!/usr/bin/env bash
# Make sure the host can build the compiled envd (envd/go, orchestrator/images/envd_go.py): Go and Debian's Go gRPC
# and protobuf libraries. No Go module proxy is reachable here, so the libraries come from Debian's packages.
set -euo pipefail

pkgs=(golang-go golang-google-grpc-dev golang-google-protobuf-dev protoc-gen-go-grpc)
need=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "ensure-go: installing ${need[*]}"
  sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi
