#!/usr/bin/env bash
# Builds the Go tools the tests use besides the control plane, from Go modules (no release downloads):
# kstatus (sigs.k8s.io/cli-utils/pkg/kstatus, what Flux and kpt compute from an object's status), from the
# pinned wrapper module in hack/kstatus. Binaries land in $TOKENFLEET_TOOLS_DIR (default .cache/bin/tools)
# and are reused while the stamp written there matches the pinned versions and the sources.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
mod="$here/kstatus"

export GOTOOLCHAIN=local CGO_ENABLED=0
command -v go >/dev/null || { echo "tools: Go is required (apt-get install golang or /usr/local/go)" >&2; exit 1; }
BIN=${TOKENFLEET_TOOLS_DIR:-$root/.cache/bin/tools}
CLI_UTILS=$(cd "$mod" && go list -m -f '{{.Version}}' sigs.k8s.io/cli-utils)
SOURCES=$(cat "$mod/go.mod" "$mod/go.sum" "$mod/main.go" | sha256sum | cut -c1-16)
STAMP="cli-utils=$CLI_UTILS sources=$SOURCES go=$(go env GOVERSION)"

if [ -x "$BIN/kstatus" ] && [ -f "$BIN/.stamp-kstatus" ] && [ "$(cat "$BIN/.stamp-kstatus")" = "$STAMP" ]; then
  echo "tools: kstatus cached in $BIN ($STAMP)"; exit 0
fi
mkdir -p "$BIN"
start=$(date +%s)
cd "$mod"
go build -trimpath -ldflags "-s -w" -o "$BIN/kstatus.tmp" .
mv "$BIN/kstatus.tmp" "$BIN/kstatus"
echo "$STAMP" > "$BIN/.stamp-kstatus"
echo "tools: built kstatus (cli-utils $CLI_UTILS) in $(( $(date +%s) - start ))s into $BIN"
