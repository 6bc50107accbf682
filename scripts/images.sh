#!/usr/bin/env bash
# Build the three images (operator, gateway, engine) with Docker's classic builder
# (DOCKER_BUILDKIT=0: no BuildKit, no buildx, no `# syntax` frontend to pull), starting a
# Docker engine first when none answers, then smoke-test them (tests/test_images.py).
#
#   scripts/images.sh [build] [smoke] [stop]     default: build smoke
#
# build   starts dockerd when `docker info` fails (as root: installs Debian's docker.io
#         when missing, keeps its data under $CACHE/docker, its log in $CACHE/dockerd.log),
#         builds the base when BASE=local, then the images: $PREFIX/sluice-{operator,
#         gateway,engine}:$TAG, each with its build stage tagged (…-build:$TAG) as the next
#         build's layer cache; what earlier builds left is pruned.
# smoke   runs tests/test_images.py against those images with .venv's pytest.
# stop    stops the dockerd this script started (its pidfile), nothing else.
#
# Environment:
#   BASE=local       the bases are a Debian bookworm made here with debootstrap from the
#                    machine's own Debian mirror, with the machine's CA certificates (a
#                    TLS-inspecting proxy's among them, so pip inside builds trusts it),
#                    imported as $LOCAL_BASE and kept for later builds. For machines that
#                    reach no container registry; these images are for this machine only.
#   BASE=official    the Dockerfiles' own ARG defaults (python:3.11-slim, nvidia/cuda),
#                    pulled from Docker Hub, as released images are built.
#   TAG=dev PREFIX=local IMAGES="operator gateway engine"
#   TORCH_INDEX_URL  the engine's torch index (empty: pip's default, PyPI's CUDA build)
#   CACHE            ${XDG_CACHE_HOME:-~/.cache}/sluice-images
#   DEBIAN_MIRROR    default: the first URIs: of /etc/apt/sources.list.d/*.sources
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice-images}"
BASE="${BASE:-local}"
TAG="${TAG:-dev}"
PREFIX="${PREFIX:-local}"
IMAGES="${IMAGES:-operator gateway engine}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
LOCAL_BASE="${LOCAL_BASE:-local/debian:bookworm}"
PIDFILE="$CACHE/dockerd.pid"
export DOCKER_BUILDKIT=0

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'images.sh: %s\n' "$*" >&2; exit 1; }

engine_up() { docker info >/dev/null 2>&1; }

# Debian's packages: the engine (docker.io) and the base builder (debootstrap).
need_packages() {
  local missing=() cmd pkg
  for cmd in "$@"; do
    case "$cmd" in dockerd) pkg=docker.io ;; *) pkg="$cmd" ;; esac
    command -v "$cmd" >/dev/null || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  [[ $EUID -eq 0 ]] || die "missing ${missing[*]}: install them (apt-get install -y ${missing[*]})"
  log "installing ${missing[*]}"
  apt-get install -y "${missing[@]}" >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y "${missing[@]}" >/dev/null; }
}

start_engine() {
  engine_up && return 0
  [[ -z "${DOCKER_HOST:-}" ]] || die "DOCKER_HOST=$DOCKER_HOST does not answer"
  [[ $EUID -eq 0 ]] || die "no Docker engine answers, and starting one needs root"
  need_packages dockerd
  mkdir -p "$CACHE/docker"
  log "starting dockerd (data under $CACHE/docker, log $CACHE/dockerd.log)"
  # setsid: the engine outlives this script (and make), for the smoke tests and later use
  setsid dockerd --data-root "$CACHE/docker" --pidfile "$PIDFILE" \
    >>"$CACHE/dockerd.log" 2>&1 </dev/null &
  local _
  for _ in $(seq 120); do
    engine_up && return 0
    kill -0 $! 2>/dev/null || break
    sleep 0.5
  done
  tail -20 "$CACHE/dockerd.log" >&2
  die "dockerd did not come up"
}

stop_engine() {
  [[ -f "$PIDFILE" ]] || { echo "no dockerd started by this script ($PIDFILE)"; return 0; }
  local pid
  pid="$(cat "$PIDFILE")"
  log "stopping dockerd $pid"
  kill "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
}

mirror() {
  if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local m
  m="$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)"
  [[ -n "$m" ]] || m="$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
  echo "${m:-http://deb.debian.org/debian}"
}

# The CA certificates this machine adds to Debian's (/usr/local/share/ca-certificates): the
# base carries them, and is made again when they change.
local_cas() { find /usr/local/share/ca-certificates -name '*.crt' -type f 2>/dev/null | sort; }
cas_digest() {
  local files
  mapfile -t files < <(local_cas)
  { ((${#files[@]})) && cat "${files[@]}"; true; } | sha256sum | cut -c1-16
}

local_base() {
  local want have
  want="$(cas_digest)"
  have="$(docker image inspect -f '{{index .Config.Labels "dev.sluice.cas"}}' "$LOCAL_BASE" \
    2>/dev/null || true)"
  if [[ "$have" == "$want" ]]; then return 0; fi
  [[ $EUID -eq 0 ]] || die "making $LOCAL_BASE with debootstrap needs root"
  need_packages debootstrap
  local dir="$CACHE/base" started=$SECONDS
  rm -rf "$dir" && mkdir -p "$dir"
  log "debootstrap bookworm from $(mirror) into $dir/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$dir/rootfs" "$(mirror)" >"$dir/debootstrap.log" 2>&1 \
    || { tail -20 "$dir/debootstrap.log" >&2; die "debootstrap failed ($dir/debootstrap.log)"; }
  local cas
  mapfile -t cas < <(local_cas)
  if ((${#cas[@]})); then
    cp "${cas[@]}" "$dir/rootfs/usr/local/share/ca-certificates/"
    chroot "$dir/rootfs" update-ca-certificates >/dev/null
  fi
  chroot "$dir/rootfs" apt-get clean
  rm -rf "$dir/rootfs/var/lib/apt/lists/"*
  # pip reads certifi's bundle, not the system's: point it at the one holding the CAs above
  tar -C "$dir/rootfs" -c . | docker import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change "LABEL dev.sluice.cas=$want" --change 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$dir"
  log "$LOCAL_BASE made in $((SECONDS - started)) s"
}

image_ref() { echo "$PREFIX/sluice-$1:$TAG"; }

build_image() {
  local name="$1" dockerfile base_arg=PYTHON_IMAGE args=() started=$SECONDS
  case "$name" in
    operator) dockerfile=operator/Dockerfile ;;
    gateway) dockerfile=gateway/Dockerfile ;;
    engine) dockerfile=engine_image/Dockerfile base_arg=BASE_IMAGE
            args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL") ;;
    *) die "unknown image $name (operator, gateway, engine)" ;;
  esac
  [[ "$BASE" != local ]] || args+=(--build-arg "$base_arg=$LOCAL_BASE")
  # host network: the build's pip and apt reach what this machine reaches, as it does
  args+=(--network host --force-rm -f "$dockerfile")
  # The build stage tagged too, so that pruning what the last build left (a 5.3 GB layer
  # per engine build) keeps the layers this one reuses (torch's 2.6 GB of wheels).
  log "building $(image_ref "$name-build") ($dockerfile, its build stage)"
  docker build "${args[@]}" --target build --label "dev.sluice.image=$name-build" \
    -t "$(image_ref "$name-build")" "$ROOT"
  log "building $(image_ref "$name") ($dockerfile)"
  docker build "${args[@]}" --label "dev.sluice.image=$name" -t "$(image_ref "$name")" "$ROOT"
  docker image prune -f --filter label=dev.sluice.image >/dev/null
  local size
  size="$(docker image inspect -f '{{.Size}}' "$(image_ref "$name")")"
  printf '%s built in %d s, %d MB\n' "$(image_ref "$name")" "$((SECONDS - started))" \
    "$((size / 1000000))" | tee -a "$CACHE/builds.log" >&2
}

build() {
  mkdir -p "$CACHE"
  start_engine
  case "$BASE" in
    local) local_base ;;
    official) ;;
    *) die "BASE=$BASE: local or official" ;;
  esac
  local name
  for name in $IMAGES; do build_image "$name"; done
}

smoke() {
  engine_up || die "no Docker engine answers: run scripts/images.sh build first"
  local py="$ROOT/.venv/bin/python"
  [[ -x "$py" ]] || die "no $py: make install first"
  SLUICE_IMAGE_PREFIX="$PREFIX" SLUICE_IMAGE_TAG="$TAG" \
    "$py" -m pytest -q -p no:cacheprovider "$ROOT/tests/test_images.py"
}

(($#)) || set -- build smoke
for step in "$@"; do
  case "$step" in
    build) build ;;
    smoke) smoke ;;
    stop) stop_engine ;;
    *) die "unknown step $step (build, smoke, stop)" ;;
  esac
done
