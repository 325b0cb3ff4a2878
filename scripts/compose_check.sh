#!/usr/bin/env bash
# End-to-end check of the Docker deployment (deploy/docker-compose.yml), as a user's first `up` would run it:
# installs and starts dockerd if needed, builds a Debian base image locally (no registry needed), the kvpool
# image and Debian-packaged etcd and Prometheus images, then scripts/compose_check.py brings the stack up,
# checks chat answers and cache hits through the published gateway port, Prometheus's scrape, crashes of
# the storage node and of the master leader, tears the stack down and prints one JSON line.
# Not part of `make test`: it needs root, a Docker daemon and several minutes. Exit 0 when every check held.
#
#   sudo scripts/compose_check.sh
#
# Environment: KVPOOL_BASE_IMAGE  an existing base image (python3 + venv) instead of the debootstrap one
#              TORCH_INDEX        pip index for the CPU torch wheel (default: a local torch-2.13.0+cpu wheel
#                                 in $PIP_FIND_LINKS or /opt/wheels if there is one, else PyTorch's CPU index)
#              PYTHON             interpreter for the checks, with openai, httpx and pyyaml (default .venv)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
IMAGE=kvpool:0.1.0
log() { echo "[compose_check] $*" >&2; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

CLEANUP=()
cleanup() { for c in "${CLEANUP[@]}"; do eval "$c" || true; done; }
trap cleanup EXIT

# 1. Docker: Debian's docker.io; vfs works in any container or VM (no overlay mounts needed).
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    log "installing docker.io"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null
  fi
  log "starting dockerd --storage-driver vfs (log: /var/log/kvpool-dockerd.log)"
  nohup dockerd --storage-driver vfs >/var/log/kvpool-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null
fi
if docker compose version >/dev/null 2>&1; then
  COMPOSE="docker compose"
else
  command -v docker-compose >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-compose >/dev/null
  COMPOSE=docker-compose
fi

# 2. Images. The base comes from Debian's mirror; etcd and Prometheus are Debian's packages on it.
t0=$(now)
BASE=${KVPOOL_BASE_IMAGE:-kvpool-base:bookworm}
[ -n "${KVPOOL_BASE_IMAGE:-}" ] || bash scripts/compose_base_image.sh "$BASE" >&2
BASE_S=$(since "$t0")

if [ -z "${TORCH_INDEX:-}" ]; then
  # shellcheck disable=SC2086  # PIP_FIND_LINKS is a space-separated list
  WHEEL=$(find ${PIP_FIND_LINKS:-} /opt/wheels -maxdepth 1 -name 'torch-2.13.0+cpu-cp311-*.whl' 2>/dev/null | head -1 || true)
  if [ -n "$WHEEL" ]; then  # a one-file index on loopback; the build runs on the host network to reach it
    INDEX_DIR=$(mktemp -d /tmp/kvpool-torch-index.XXXXXX)
    mkdir "$INDEX_DIR/torch" && ln -s "$WHEEL" "$INDEX_DIR/torch/"
    PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    python3 -m http.server --bind 127.0.0.1 --directory "$INDEX_DIR" "$PORT" >/dev/null 2>&1 &
    CLEANUP+=("kill $!" "rm -rf $INDEX_DIR")
    TORCH_INDEX=http://127.0.0.1:$PORT/
    log "torch from $WHEEL"
  fi
fi
TORCH_ARG=()
[ -z "${TORCH_INDEX:-}" ] || TORCH_ARG=(--build-arg "TORCH_INDEX=$TORCH_INDEX")

build() {  # build TAG DOCKERFILE CONTEXT [ARGS...]; quiet unless it fails
  local tag=$1 file=$2 ctx=$3 out
  shift 3
  log "building $tag"
  out=$(mktemp)
  if ! docker build --network host --build-arg "BASE=$BASE" "$@" -f "$file" -t "$tag" "$ctx" >"$out" 2>&1; then
    tail -30 "$out" >&2
    rm -f "$out"
    return 1
  fi
  rm -f "$out"
}
t0=$(now)
build "$IMAGE" deploy/Dockerfile . "${TORCH_ARG[@]}"
BUILD_S=$(since "$t0")
t0=$(now)
build kvpool-etcd:debian deploy/debian/etcd.Dockerfile deploy/debian
build kvpool-prometheus:debian deploy/debian/prometheus.Dockerfile deploy/debian
AUX_S=$(since "$t0")
export KVPOOL_ETCD_IMAGE=kvpool-etcd:debian KVPOOL_PROMETHEUS_IMAGE=kvpool-prometheus:debian
SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE")

# 3. The cluster secret (docs/design/internal_auth.md), made for this run unless the user has one.
if [ ! -f deploy/cluster.secret ]; then
  python3 -c "import secrets; print(secrets.token_hex(32))" >deploy/cluster.secret
  CLEANUP+=("rm -f $ROOT/deploy/cluster.secret")
fi
PROFILES=()
if docker image inspect grafana/grafana:12.1.0 >/dev/null 2>&1; then PROFILES=(--profile grafana); fi

# 4. The stack and its checks.
EXTRA=$(python3 -c 'import json, sys; a = sys.argv[1:]; print(json.dumps({"compose": a[0], "base_image": a[1],
  "image_bytes": int(a[2]), "base_build_s": float(a[3]), "image_build_s": float(a[4]),
  "etcd_prometheus_build_s": float(a[5]), "grafana": a[6] != "0"}))' \
  "$COMPOSE" "$BASE" "$SIZE" "$BASE_S" "$BUILD_S" "$AUX_S" "${#PROFILES[@]}")
log "bringing the stack up ($COMPOSE)"
"$PY" scripts/compose_check.py --compose "$COMPOSE" --image "$IMAGE" "${PROFILES[@]}" --extra "$EXTRA"
