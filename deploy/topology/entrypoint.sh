#!/bin/sh
# Worker entrypoint: load the node's topology written by the init container, pick the
# socket interface NCCL and gloo bootstrap on, then run the command unchanged.
# Variables set in the pod spec always win over both.
set -eu

env_file="${REGROUP_TOPOLOGY_ENV:-/etc/regroup/topology/env}"
if [ -r "$env_file" ]; then
    # shellcheck disable=SC1090
    . "$env_file"
else
    echo "regroup-entrypoint: no topology file at $env_file; NCCL will probe the transport" >&2
fi

if [ -z "${NCCL_SOCKET_IFNAME:-}" ]; then
    # The interface of the default route is the pod network; NCCL's own guess may pick
    # a bridge or a link-local device that other pods cannot reach.
    iface="$(awk '$1 != "Iface" && $2 == "00000000" { print $1; exit }' /proc/net/route 2>/dev/null || true)"
    if [ -n "$iface" ]; then
        NCCL_SOCKET_IFNAME="$iface"
        if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
            GLOO_SOCKET_IFNAME="$iface"
            export GLOO_SOCKET_IFNAME
        fi
    else
        NCCL_SOCKET_IFNAME="^lo,docker"
    fi
fi
export NCCL_SOCKET_IFNAME

exec "$@"
