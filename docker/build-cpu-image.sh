#!/usr/bin/env bash
# Build the offline CPU image of the harness (no Docker Hub): a debootstrap base, the torch CPU
# wheel from /opt/wheels, the PyPI dependencies, then the harness source.
#   docker/build-cpu-image.sh [--push] [--no-cache] [TAG]   (TAG defaults to localhost:5000/harness-cpu:0.1)
# --push pushes TAG to its registry so the image gets a RepoDigest (what experiment.yaml pins).
# --no-cache rebuilds every layer (the debootstrap base is reused if present).
# Needs a running engine (scripts/docker-up.sh STATE_DIR), and for --push the local registry.
set -euo pipefail

usage() { echo "usage: $0 [--push] [--no-cache] [TAG]" >&2; exit 2; }
PUSH=0
CACHE=()
TAG=localhost:5000/harness-cpu:0.1
tag_set=0
for arg in "$@"; do
  case $arg in
    --push) PUSH=1 ;;
    --no-cache) CACHE=(--no-cache) ;;
    -h | --help) usage ;;
    -*) echo "unknown option $arg" >&2; usage ;;
    *) ((tag_set == 0)) || usage; TAG=$arg; tag_set=1 ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${HARNESS_BASE_IMAGE:-harness/base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=${TORCH_WHEEL_DIR:-/opt/wheels}

step() { echo "build-cpu-image: $*"; }
die() { echo "build-cpu-image: error: $*" >&2; exit 1; }

docker version >/dev/null 2>&1 \
  || die "Docker engine is not running. Start it with scripts/docker-up.sh STATE_DIR and retry."

TMP=$(mktemp -d /tmp/harness-cpu-build.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

# --- base image ------------------------------------------------------------------------------
if docker image inspect "$BASE" >/dev/null 2>&1; then
  step "base $BASE present"
else
  command -v debootstrap >/dev/null || die "debootstrap not found. apt-get install -y debootstrap, or run scripts/docker-up.sh."
  step "debootstrap bookworm (minbase + python3.11, venv, pip) into $TMP/rootfs"
  start=$SECONDS
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$TMP/rootfs" "$MIRROR" >"$TMP/debootstrap.log" 2>&1 \
    || { tail -n 20 "$TMP/debootstrap.log" >&2; die "debootstrap failed (mirror $MIRROR)."; }
  rm -rf "$TMP/rootfs/var/cache/apt/archives/"*.deb "$TMP/rootfs/var/lib/apt/lists/"*
  tar -C "$TMP/rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$TMP/rootfs"
  step "imported $BASE in $((SECONDS - start))s"
fi

# --- build context ---------------------------------------------------------------------------
CTX=$TMP/context
mkdir -p "$CTX/wheels" "$CTX/src" "$CTX/certs"
shopt -s nullglob
wheels=("$WHEELS"/torch-2.13.0+cpu-cp311-cp311-*.whl)
shopt -u nullglob
((${#wheels[@]} == 1)) || die "expected one torch-2.13.0+cpu cp311 wheel in $WHEELS, found ${#wheels[@]}. Set TORCH_WHEEL_DIR."
# A hard link avoids copying ~200 MB when /tmp and the wheel share a filesystem.
ln "${wheels[0]}" "$CTX/wheels/" 2>/dev/null || cp "${wheels[0]}" "$CTX/wheels/"

# pip inside the build trusts what the host trusts: some networks intercept TLS with their own CA.
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
[[ -f $CA_BUNDLE ]] || die "CA bundle $CA_BUNDLE not found. Set CA_BUNDLE to the PEM file pip should trust."
cp "$CA_BUNDLE" "$CTX/certs/ca-bundle.crt"

# The image's dependencies come from pyproject.toml, so the two cannot drift; torch is the wheel.
python3 - "$ROOT/pyproject.toml" >"$CTX/requirements.txt" <<'PY'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() != "torch"))
PY

cp "$ROOT/pyproject.toml" "$CTX/src/"
if [[ -f $ROOT/README.md ]]; then
  cp "$ROOT/README.md" "$CTX/src/"
else
  echo "# harness" >"$CTX/src/README.md"  # pyproject names it as the readme
fi
tar -C "$ROOT" -c --exclude=__pycache__ --exclude='*.pyc' harness | tar -C "$CTX/src" -x

# --- build -----------------------------------------------------------------------------------
step "building $TAG (legacy builder) from docker/cpu/Dockerfile"
start=$SECONDS
DOCKER_BUILDKIT=0 docker build "${CACHE[@]}" -f "$ROOT/docker/cpu/Dockerfile" --build-arg "BASE=$BASE" -t "$TAG" "$CTX"
step "built $TAG in $((SECONDS - start))s"

if ((PUSH)); then
  step "pushing $TAG"
  start=$SECONDS
  docker push "$TAG"
  step "pushed $TAG in $((SECONDS - start))s"
fi

repo=${TAG%@*}
[[ ${repo##*/} == *:* ]] && repo=${repo%:*}
image_id=$(docker image inspect --format '{{.Id}}' "$TAG")
repo_digest=$(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$TAG" | grep -F "$repo@" | head -n 1 || true)
echo "image id:    $image_id"
echo "repo digest: ${repo_digest:-none (push it with --push to get one)}"
