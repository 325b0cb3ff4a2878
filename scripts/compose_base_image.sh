#!/usr/bin/env bash
# Builds a Debian bookworm base image with python3 + pip + venv, for Docker hosts that reach Debian's
# package mirror but no image registry (deploy/Dockerfile then builds FROM it: --build-arg BASE=<this tag>).
# debootstrap makes the root file system, `docker import` turns it into an image. Idempotent: an existing
# tag is kept. Usage: scripts/compose_base_image.sh [TAG]   (root; needs debootstrap and a running dockerd)
set -euo pipefail

TAG=${1:-kvpool-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"
  exit 0
fi
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null

ROOTFS=$(mktemp -d /tmp/kvpool-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap bookworm (minbase + python3, pip, venv) into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
# The host's own CA certificates go in too: where the host reaches the package registries through a
# TLS-inspecting proxy, builds FROM this image must trust the same CA (pip reads PIP_CERT).
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
# Image hygiene: no downloaded .debs or package lists (an image's apt-get runs `apt-get update` first).
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/tmp/*
chmod 755 "$ROOTFS"  # mktemp made it 0700: the image's / would be closed to every non-root user
tar -C "$ROOTFS" -c . | docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  -c 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "base image $TAG built"
