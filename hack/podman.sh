#!/usr/bin/env bash
# podman with tokenfleet's own image store: `bash hack/podman.sh images`, `bash hack/podman.sh run ...`.
#
# Images and their layer cache live in the ignored .cache/containers/storage (or $TOKENFLEET_CONTAINERS_DIR),
# never in the machine-wide store. The configuration is written next to it on every call:
#   - runc, not crun: crun refuses this machine kind's hybrid cgroup layout (v1 controllers plus a
#     cgroup2 mount with controllers: "cgroups in hybrid mode not supported");
#   - cgroupfs, not systemd: there is no systemd;
#   - no rlimits in the OCI spec (default_ulimits = []): by default podman asks for RLIMIT_NOFILE
#     1048576, and raising a hard limit fails here even as root ("setrlimit RLIMIT_NOFILE: Operation not
#     permitted"), so containers inherit the limits of the process that starts them instead;
#   - no unqualified-name searches: every FROM names a local image or a full reference;
#   - temporary files (a layer being committed, an image being copied: several GB for the serving image's
#     torch layer) go under $dir/tmp, on the disk the store is on, not /var/tmp, which may be a small or
#     shared filesystem (a commit whose temporary file cannot be written fails "read/write on closed pipe").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${TOKENFLEET_CONTAINERS_DIR:-$root/.cache/containers}
mkdir -p "$dir/storage" "$dir/tmp"
# Sockets and locks want a short path (a unix socket path has at most 107 bytes) that a reboot clears.
run="/run/tokenfleet-podman-$(echo -n "$dir" | sha256sum | cut -c1-10)"
mkdir -p "$run"

write() {  # write FILE only when its content changes (podman rereads it on every call)
  local f=$1 content
  content=$(cat)
  [ -f "$f" ] && [ "$(cat "$f")" = "$content" ] && return 0
  printf '%s\n' "$content" > "$f.tmp" && mv "$f.tmp" "$f"
}
write "$dir/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$run/storage"
EOF
write "$dir/containers.conf" <<EOF
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$run/libpod"
image_copy_tmp_dir = "$dir/tmp"
EOF
write "$dir/registries.conf" <<EOF
unqualified-search-registries = []
EOF
export CONTAINERS_STORAGE_CONF="$dir/storage.conf" CONTAINERS_CONF="$dir/containers.conf" \
       CONTAINERS_REGISTRIES_CONF="$dir/registries.conf"
export TMPDIR="$dir/tmp"
exec podman "$@"
