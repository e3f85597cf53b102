#!/usr/bin/env bash
# Build the service's image (Dockerfile) with docker, podman or buildah: the one IMAGE_BUILDER
# names, else the first of those present (docker only if its daemon answers).
#
#   scripts/image.sh builder     print the builder that would be used (nothing: none found)
#   scripts/image.sh build       build $IMAGE (`make image`)
#
# IMAGE         the tag (default llm-admission:<version from pyproject.toml>)
# PYTHON_IMAGE  the base image (default: the Dockerfile's pinned python:...-slim-bookworm); name a
#               local one to build without a registry
# IMAGE_PULL    podman/buildah pull policy for the base: missing (default), never, always
#               (docker uses a local base if it has one and pulls only when it does not)
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
IMAGE=${IMAGE:-llm-admission:${version}}
IMAGE_PULL=${IMAGE_PULL:-missing}

pick_builder() {
  if [ -n "${IMAGE_BUILDER:-}" ]; then
    case "$IMAGE_BUILDER" in
      docker|podman|buildah) ;;
      *) echo "IMAGE_BUILDER=$IMAGE_BUILDER: must be docker, podman or buildah" >&2; return 2 ;;
    esac
    command -v "$IMAGE_BUILDER" >/dev/null || { echo "IMAGE_BUILDER=$IMAGE_BUILDER: not found on PATH" >&2; return 2; }
    echo "$IMAGE_BUILDER"
    return 0
  fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return 0; fi
  for b in podman buildah; do
    if command -v "$b" >/dev/null; then echo "$b"; return 0; fi
  done
  return 0
}

build() {
  local builder
  builder=$(pick_builder)
  if [ -z "$builder" ]; then
    echo "no container builder: install docker (with its daemon running), podman or buildah, or set IMAGE_BUILDER" >&2
    return 3
  fi
  local args=(-t "$IMAGE" -f Dockerfile)
  if [ -n "${PYTHON_IMAGE:-}" ]; then args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"); fi
  echo "building $IMAGE with $builder${PYTHON_IMAGE:+ on $PYTHON_IMAGE}" >&2
  case "$builder" in
    docker) docker build "${args[@]}" . ;;
    podman) podman build --pull="$IMAGE_PULL" "${args[@]}" . ;;
    buildah) buildah bud --pull="$IMAGE_PULL" "${args[@]}" . ;;
  esac
}

case "${1:-build}" in
  builder) pick_builder ;;
  build) build ;;
  *) echo "usage: $0 [builder|build]" >&2; exit 2 ;;
esac
