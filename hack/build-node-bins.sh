#!/usr/bin/env bash
# Builds what a real node of the local plane runs that Debian does not ship: the kubelet, from the same
# pinned wrapper module as the control plane (hack/kube-bins), so its version matches the API server's.
# containerd, runc and the CNI plugins come from Debian (hack/setup.sh installs them).
# The kubelet lands in $TOKENFLEET_NODE_BIN_DIR (default .cache/bin/<k8s>-node) and is reused while the
# pinned versions match the stamp written there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
mod="$here/kube-bins"

export GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { [ -x /usr/local/go/bin/go ] && export PATH=/usr/local/go/bin:$PATH; }
command -v go >/dev/null || { echo "node-bins: Go is required" >&2; exit 1; }
K8S=$(cd "$mod" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
MINOR=$(echo "$K8S" | cut -d. -f2)
BIN=${TOKENFLEET_NODE_BIN_DIR:-$root/.cache/bin/$K8S-node}
STAMP="k8s=$K8S go=$(go env GOVERSION)"

if [ -f "$BIN/.stamp" ] && [ "$(cat "$BIN/.stamp")" = "$STAMP" ] && [ -x "$BIN/kubelet" ]; then
  echo "node-bins: cached in $BIN ($STAMP)"; exit 0
fi
mkdir -p "$BIN"
start=$(date +%s)
cd "$mod"
LD="-s -w -buildid="
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD+=" -X $p.gitVersion=$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MINOR"
  LD+=" -X $p.gitTreeState=clean -X $p.gitCommit=module-$K8S -X $p.buildDate=1970-01-01T00:00:00Z"
done
echo "node-bins: building kubelet $K8S (shares most packages with the control plane's GOCACHE)"
go build -trimpath -tags notest -ldflags "$LD" -o "$BIN/kubelet.tmp" k8s.io/kubernetes/cmd/kubelet
mv "$BIN/kubelet.tmp" "$BIN/kubelet"
"$BIN/kubelet" --version
echo "$STAMP" > "$BIN/.stamp"
echo "node-bins: kubelet built in $(( $(date +%s) - start ))s into $BIN"
