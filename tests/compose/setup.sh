#!/usr/bin/env bash
# Makes `make test-compose` runnable on a fresh Debian machine with no Docker engine and no image
# registry (shared/reference facts: podman 4.3.1 and podman-compose 1.0.3 from Debian bookworm):
#   1. installs podman, podman-compose, runc and debootstrap from the OS packages when missing
#      (as .ci/run does for redis-server);
#   2. builds the local base image $AMPD_BASE_IMAGE (default localhost/debian-py:bookworm: a
#      debootstrap minbase with Python 3.11 and venv, imported with `podman import`) when missing.
# The podman settings that work here (runc, cgroupfs, no default ulimits) are in
# tests/compose/containers.conf; stack.py points CONTAINERS_CONF at it, so /etc is left alone.
# Set AMPD_BASE_IMAGE to an image podman can pull (e.g. docker.io/library/python:3.11-slim) to skip 2.
# Podman runs rootful (as root; CI does), which is what the measured settings cover.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$(id -u)" != 0 ]; then
  echo "make test-compose runs podman as root (rootful, as CI does): run it as root" >&2
  exit 1
fi

export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/tests/compose/containers.conf}"
BASE_IMAGE="${AMPD_BASE_IMAGE:-localhost/debian-py:bookworm}"
PODMAN_COMPOSE_DEB=1.0.3-3

missing=()
for tool in podman podman-compose runc; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "$BASE_IMAGE" = localhost/debian-py:bookworm ] && ! command -v debootstrap >/dev/null 2>&1; then
  missing+=(debootstrap)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} from the OS packages"
  apt-get update -q
  # podman-compose pinned to the release whose quirks stack.py copes with (bookworm's).
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman "podman-compose=$PODMAN_COMPOSE_DEB" runc debootstrap
fi
echo "$(podman --version), $(podman-compose version 2>/dev/null | grep -i '^podman-compose' | tr -s ' ')"
case "$(podman-compose version 2>/dev/null)" in
  *" 1.0.3"*) ;;
  *) echo "warning: stack.py was written against podman-compose 1.0.3 (apt: podman-compose=$PODMAN_COMPOSE_DEB)" >&2 ;;
esac
if ! podman info >/dev/null 2>&1; then
  echo "podman cannot run here (podman info fails with CONTAINERS_CONF=$CONTAINERS_CONF):" >&2
  podman info >&2 || true
  exit 1
fi

if podman image exists "$BASE_IMAGE"; then
  echo "base image $BASE_IMAGE: present"
elif [ "$BASE_IMAGE" != localhost/debian-py:bookworm ]; then
  podman pull "$BASE_IMAGE"
else
  # The Debian mirror apt already uses (deb822 sources first, then sources.list).
  mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*debian\/\?\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  root=$(mktemp -d /tmp/ampd-debootstrap.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "building $BASE_IMAGE: debootstrap bookworm from $mirror (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --quiet - "$BASE_IMAGE" >/dev/null
  echo "base image $BASE_IMAGE: built ($(podman run --rm "$BASE_IMAGE" python3 -V))"
fi
