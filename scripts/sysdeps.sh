#!/usr/bin/env bash
# System packages the project needs (Debian). Installed only when missing; quiet otherwise.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# iproute2 + iptables: `kvpool up --netns` and its fault tests build namespaces, shape links and drop packets
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
# etcd: `kvpool up --ha` runs etcd members, and the masters elect their leader there
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "note: missing system packages (${need[*]}); benchmarks that need them will say so and skip" >&2
  fi
fi
