#!/bin/sh
# The serving image's entrypoint: the `tokenfleet` command, whose subcommands
# (`serve`, `bench serve`, `bench engine`, ...) are the same in the image and in
# a local process under the local pod runner. A leading "tokenfleet" is
# accepted, so a pod spec's `command: [tokenfleet, serve, ...]` and
# `args: [serve, ...]` both work. `exec` makes the server PID 1 in a container,
# so SIGTERM reaches it directly and starts the drain.
set -eu
if [ "${1:-}" = "tokenfleet" ]; then
    shift
fi
if [ "$#" -eq 0 ]; then
    set -- --help
fi
exec tokenfleet "$@"
