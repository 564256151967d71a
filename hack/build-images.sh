#!/usr/bin/env bash
# Builds tokenfleet's two images from their Dockerfiles, from the repository root, with no Docker daemon
# and no registry:
#
#   1. the base, localhost/tokenfleet/base-python:bookworm: Debian bookworm's python3 (with venv), CA
#      certificates and libgomp, assembled from Debian packages with mmdebstrap and imported into podman;
#   2. tokenfleet/operator:VERSION from operator/Dockerfile and tokenfleet/serving:VERSION from
#      serving-image/Dockerfile (VERSION: pyproject.toml's), with podman build (buildah) on that base;
#      torch and the other Python packages come from PyPI, gcc for the serving image's build stage from
#      Debian.
#
# Layers are cached in .cache/containers (hack/podman.sh), so a second run rebuilds only what changed.
# Every stage is tagged localhost/tokenfleet-cache/... so pruning dangling images never drops the cache.
# Prints each image's size and the time each step took; writes them to .cache/images/build-report.json.
#
#   bash hack/build-images.sh                 both images
#   bash hack/build-images.sh serving         one of them (operator | serving)
#   TOKENFLEET_SERVING_VARIANT=slim ...       the serving image without torch's triton (torch.compile's
#                                             backend, which the engine never uses): ~1 GB smaller
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
P=(bash "$root/hack/podman.sh")
PY=${PYTHON:-python3}
VERSION=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
SUITE=bookworm
MIRROR=${TOKENFLEET_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${TOKENFLEET_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PACKAGES=python3,python3-venv,ca-certificates,libgomp1
BASE=localhost/tokenfleet/base-python:$SUITE
VARIANT=${TOKENFLEET_SERVING_VARIANT:-full}
case "$VARIANT" in
  full) TORCH_DROP= ;;
  slim) TORCH_DROP=triton ;;
  *) echo "build-images: TOKENFLEET_SERVING_VARIANT must be full or slim, got $VARIANT" >&2; exit 2 ;;
esac
images=("${@:-operator serving}")
read -r -a images <<< "${images[*]}"
report_dir=$root/.cache/images
mkdir -p "$report_dir"

for tool in podman mmdebstrap runc; do
  command -v "$tool" >/dev/null || { echo "build-images: $tool is missing (bash hack/setup.sh installs it)" >&2; exit 1; }
done

start=$(date +%s)
declare -A took
step() { echo "build-images: [$(( $(date +%s) - start ))s] $*"; }
timed() {  # timed KEY CMD...: run CMD, remember its wall time under KEY
  local key=$1 t0; shift; t0=$(date +%s)
  "$@"
  took[$key]=$(( $(date +%s) - t0 ))
}

# ----------------------------------------------------------------- base
base_image() {  # base_image NAME PACKAGES: mmdebstrap -> podman import, unless the same stamp is there
  local name=$1 packages=$2 stamp
  stamp="$SUITE $packages $MIRROR"
  if [ "$("${P[@]}" image inspect --format '{{ index .Labels "dev.tokenfleet.base" }}' "$name" 2>/dev/null)" = "$stamp" ]; then
    step "$name: cached"; return 0
  fi
  step "$name: mmdebstrap $SUITE with $packages"
  # Debian's documentation, manual pages and translations are left out; copyright files stay.
  mmdebstrap --quiet --mode=root --variant=minbase --format=tar --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    "$SUITE" - "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY $SUITE-security main" \
  | "${P[@]}" import --quiet \
      --change "LABEL dev.tokenfleet.base=\"$stamp\"" \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
      --change 'CMD ["python3"]' - "$name" >/dev/null
}
timed bases base_image "$BASE" "$PACKAGES"

# --------------------------------------------------------------- images
quiet() { sed -u -E '/^(Copying (blob|config)|Writing manifest|Storing signatures)/d'; }
retried() {  # retried CMD...: run CMD; once more if it fails (a download or a layer commit that broke
  # midway; the layers already committed are cached, so the second try redoes only the broken step)
  "$@" && return 0
  step "failed; trying once more"
  "$@"
}
build() {  # build NAME DOCKERFILE STAGE... : every stage tagged, the last one is the image
  local name=$1 dockerfile=$2; shift 2
  local args=(--layers --pull=never --network=host --format=oci -f "$dockerfile"
              --build-arg "PYTHON_IMAGE=$BASE")
  [ "$name" = serving ] && args+=(--build-arg "TORCH_DROP=$TORCH_DROP")
  # pip in the build trusts what pip on this machine trusts (e.g. a TLS-intercepting proxy's CA).
  local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  [ -f "$ca" ] && args+=(--secret "id=pip-ca,src=$ca")
  # one cache tag per serving variant, so switching variants keeps the other's layers
  local stage tag=latest
  [ "$name" = serving ] && tag=$VARIANT
  for stage in "$@"; do
    step "tokenfleet/$name: stage $stage"
    retried "${P[@]}" build "${args[@]}" --target "$stage" -t "localhost/tokenfleet-cache/$name-$stage:$tag" . | quiet
  done
  step "tokenfleet/$name: image"
  "${P[@]}" build "${args[@]}" -t "localhost/tokenfleet/$name:$VERSION" . | quiet
  # The name Kubernetes resolves `tokenfleet/NAME:VERSION` to, for `podman save` into a node or kind.
  "${P[@]}" tag "localhost/tokenfleet/$name:$VERSION" "docker.io/tokenfleet/$name:$VERSION"
}
for image in "${images[@]}"; do
  case "$image" in
    operator) timed operator build operator operator/Dockerfile deps build ;;
    serving) timed serving build serving serving-image/Dockerfile deps build ;;
    *) echo "build-images: unknown image $image (operator | serving)" >&2; exit 2 ;;
  esac
done
# Old layers no tag reaches any more (an earlier source or dependency state).
"${P[@]}" image prune -f >/dev/null

# --------------------------------------------------------------- report
total=$(( $(date +%s) - start ))
{
  printf '{"version": "%s", "serving_variant": "%s", "total_seconds": %d, "base_seconds": %d, "images": {' \
    "$VERSION" "$VARIANT" "$total" "${took[bases]}"
  sep=
  for image in "${images[@]}"; do
    size=$("${P[@]}" image inspect --format '{{.Size}}' "localhost/tokenfleet/$image:$VERSION")
    printf '%s"%s": {"tag": "tokenfleet/%s:%s", "size_bytes": %s, "build_seconds": %d}' \
      "$sep" "$image" "$image" "$VERSION" "$size" "${took[$image]}"
    sep=", "
  done
  printf '}, "loadavg": "%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
} > "$report_dir/build-report.json"
step "done"
"$PY" - "$report_dir/build-report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{'image':<28} {'size':>9} {'build':>7}")
for name, i in r["images"].items():
    print(f"{i['tag']:<28} {i['size_bytes'] / 1e9:>7.2f}GB {i['build_seconds']:>6}s")
print(f"base {r['base_seconds']}s, total {r['total_seconds']}s (serving variant {r['serving_variant']}, load {r['loadavg']})")
EOF
