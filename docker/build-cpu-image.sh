#!/usr/bin/env bash
# Build the offline CPU image of the harness (no Docker Hub): a debootstrap base, the torch CPU
# wheel from /opt/wheels, the PyPI dependencies, then the harness source.
#   docker/build-cpu-image.sh [--push] [--no-cache] [TAG]   (TAG defaults to localhost:5000/harness-cpu:0.1)
#   docker/build-cpu-image.sh --print-mirror                 (the Debian archive the base would use)
# --push pushes TAG to its registry so the image gets a RepoDigest (what experiment.yaml pins).
# --no-cache rebuilds every layer (the debootstrap base is reused if present).
# The base is bootstrapped from this machine's own Debian archive, read from its apt sources
# (/etc/apt/sources.list, sources.list.d/*.list and *.sources); DEBIAN_MIRROR=URL overrides it.
# Needs a running engine (scripts/docker-up.sh STATE_DIR), and for --push the local registry.
set -euo pipefail

usage() { echo "usage: $0 [--push] [--no-cache] [TAG] | --print-mirror" >&2; exit 2; }
PUSH=0
PRINT_MIRROR=0
CACHE=()
TAG=localhost:5000/harness-cpu:0.1
tag_set=0
for arg in "$@"; do
  case $arg in
    --push) PUSH=1 ;;
    --no-cache) CACHE=(--no-cache) ;;
    --print-mirror) PRINT_MIRROR=1 ;;
    -h | --help) usage ;;
    -*) echo "unknown option $arg" >&2; usage ;;
    *) ((tag_set == 0)) || usage; TAG=$arg; tag_set=1 ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${HARNESS_BASE_IMAGE:-harness/base:bookworm}
SUITE=bookworm
APT_ETC=${APT_ETC:-/etc/apt}  # where the apt sources are read from (another folder for a dry check)
WHEELS=${TORCH_WHEEL_DIR:-/opt/wheels}

step() { echo "build-cpu-image: $*"; }
die() { echo "build-cpu-image: error: $*" >&2; exit 1; }

# The first Debian main archive for $SUITE in the machine's apt sources: the mirror this network is
# known to reach. Security, updates and third-party archives do not qualify (other suites).
apt_debian_mirror() {
  local files=() f
  [[ -f $APT_ETC/sources.list ]] && files+=("$APT_ETC/sources.list")
  shopt -s nullglob
  for f in "$APT_ETC"/sources.list.d/*; do
    case $f in *.list | *.sources) files+=("$f") ;; esac
  done
  shopt -u nullglob
  for f in "${files[@]}"; do
    if [[ $f == *.sources ]]; then
      # deb822: paragraphs of "Field: value" lines (Types, URIs, Suites, Components, Enabled).
      awk -v suite="$SUITE" '
        function has(list, word,   n, i, a) { n = split(list, a, /[ \t]+/); for (i = 1; i <= n; i++) if (a[i] == word) return 1; return 0 }
        function flush() {
          if (has(f["types"], "deb") && has(f["suites"], suite) && has(f["components"], "main") && tolower(f["enabled"]) != "no") {
            split(f["uris"], u, /[ \t]+/); if (u[1] != "") print u[1]
          }
          delete f
        }
        /^[ \t]*#/ { next }
        /^[ \t]*$/ { flush(); next }
        /^[A-Za-z-]+:/ { key = tolower(substr($0, 1, index($0, ":") - 1)); val = substr($0, index($0, ":") + 1)
                         gsub(/^[ \t]+|[ \t]+$/, "", val); f[key] = val; next }
        END { flush() }' "$f"
    else
      # one-line: deb [options] URI SUITE COMPONENT...
      awk -v suite="$SUITE" '
        $1 != "deb" { next }
        { i = 2; if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
          uri = $i; if ($(i + 1) != suite) next
          for (j = i + 2; j <= NF; j++) if ($j == "main") { print uri; next } }' "$f"
    fi
  done
}

debian_mirror() {
  if [[ -n ${DEBIAN_MIRROR:-} ]]; then
    echo "$DEBIAN_MIRROR"
    return
  fi
  local found
  found=$(apt_debian_mirror)
  found=${found%%$'\n'*}
  [[ -n $found ]] || die "no Debian $SUITE main archive in the apt sources under $APT_ETC (sources.list, \
sources.list.d/*.list, *.sources). Set DEBIAN_MIRROR to the URL of a Debian mirror this machine can reach."
  echo "${found%/}"
}

if ((PRINT_MIRROR)); then
  debian_mirror
  exit 0
fi

docker version >/dev/null 2>&1 \
  || die "Docker engine is not running. Start it with scripts/docker-up.sh STATE_DIR and retry."

# One build at a time on this machine: .ci/run builds the image beside the first tests, and the Docker tests' fixture
# builds it again (every layer cached) once that build is done, never a second build of the same layers at once.
LOCK=${HARNESS_IMAGE_BUILD_LOCK:-${TMPDIR:-/tmp}/harness-cpu-image.lock}
exec 9>>"$LOCK"
if ! flock -n 9; then
  step "waiting for another build of the image to end (lock $LOCK)"
  flock 9
fi

TMP=$(mktemp -d /tmp/harness-cpu-build.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

# --- base image ------------------------------------------------------------------------------
if docker image inspect "$BASE" >/dev/null 2>&1; then
  step "base $BASE present"
else
  command -v debootstrap >/dev/null || die "debootstrap not found. apt-get install -y debootstrap, or run scripts/docker-up.sh."
  MIRROR=$(debian_mirror)
  step "debootstrap $SUITE from $MIRROR (minbase + python3.11, venv, pip) into $TMP/rootfs"
  start=$SECONDS
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$TMP/rootfs" "$MIRROR" >"$TMP/debootstrap.log" 2>&1 \
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
