#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules (no release
# downloads): kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
# and etcd from the pinned wrapper module in hack/kube-bins, KWOK from its own
# module graph. Binaries land in $TOKENFLEET_BIN_DIR (default .cache/bin/<k8s>)
# and are reused while the pinned versions match the stamp written there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
mod="$here/kube-bins"

export GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { echo "kube-bins: Go is required (apt-get install golang or /usr/local/go)" >&2; exit 1; }
K8S=$(cd "$mod" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
ETCD=$(cd "$mod" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
KWOK=v0.8.0
MINOR=$(echo "$K8S" | cut -d. -f2)
BIN=${TOKENFLEET_BIN_DIR:-$root/.cache/bin/$K8S}
STAMP="k8s=$K8S etcd=$ETCD kwok=$KWOK go=$(go env GOVERSION)"

want=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)
if [ -f "$BIN/.stamp" ] && [ "$(cat "$BIN/.stamp")" = "$STAMP" ]; then
  ok=1; for b in "${want[@]}"; do [ -x "$BIN/$b" ] || ok=0; done
  if [ $ok = 1 ]; then echo "kube-bins: cached in $BIN ($STAMP)"; exit 0; fi
fi

mkdir -p "$BIN"
start=$(date +%s)
step() { echo "kube-bins: [$(( $(date +%s) - start ))s] $*"; }

cd "$mod"
step "downloading modules for Kubernetes $K8S, etcd $ETCD"
go mod download
LD="-s -w -buildid="
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD+=" -X $p.gitVersion=$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MINOR"
  LD+=" -X $p.gitTreeState=clean -X $p.gitCommit=module-$K8S -X $p.buildDate=1970-01-01T00:00:00Z"
done
# One binary per invocation so progress is visible; the shared packages
# compile once and are reused from GOCACHE by the later binaries.
note=" (compiles most of Kubernetes: about 10 minutes on 2 cores)"
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  step "building $b$note"; note=""
  go build -trimpath -tags notest -ldflags "$LD" -o "$BIN/$b" "k8s.io/kubernetes/cmd/$b"
done
step "building etcd $ETCD"
go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
step "building kwok $KWOK (its own module graph)"
cd /
GOBIN="$BIN" GOFLAGS=-mod=mod go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK"
# kwok v0.8 ships no built-in stages: copy the ones we use next to the binary.
stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK/kustomize/stage"
rm -rf "$BIN/kwok-stages"; mkdir -p "$BIN/kwok-stages"
cp -r "$stages"/. "$BIN/kwok-stages/"; chmod -R u+w "$BIN/kwok-stages"
"$BIN/kube-apiserver" --version
# sed reads all of the output: with head, etcd could die of SIGPIPE while
# printing its later lines, and pipefail turned that into exit 141.
"$BIN/etcd" --version | sed -n 1p
"$BIN/kwok" --version 2>/dev/null | sed -n 1p || true
echo "$STAMP" > "$BIN/.stamp"
step "done; binaries in $BIN ($(du -sh "$BIN" | cut -f1))"
