#!/usr/bin/env bash
# Smoke-test the service's image: inside it, `extproc check-config` and `extproc check` against
# the engine simulator (run on the host's loopback, reached with host networking). Builds $IMAGE
# first (scripts/image.sh) unless it exists. Without docker (daemon up), podman or buildah it
# prints one line, "no container builder: skipped", and exits 0.
#
# IMAGE, IMAGE_BUILDER, PYTHON_IMAGE, IMAGE_PULL: as for scripts/image.sh. PYTHON: the interpreter
# that runs the simulator (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

builder=$(scripts/image.sh builder)
if [ -z "$builder" ]; then
  echo "no container builder: skipped"
  exit 0
fi
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
export IMAGE=${IMAGE:-llm-admission:${version}}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

exists() {
  case "$builder" in
    buildah) buildah inspect --type image "$IMAGE" >/dev/null 2>&1 ;;
    *) "$builder" image inspect "$IMAGE" >/dev/null 2>&1 ;;
  esac
}
in_image() {  # run a command in the image, on the host's network
  case "$builder" in
    buildah)
      local ctr rc=0
      ctr=$(buildah from --pull=never "$IMAGE")
      buildah run --network=host "$ctr" -- "$@" || rc=$?
      buildah rm "$ctr" >/dev/null
      return "$rc" ;;
    *) "$builder" run --rm --network=host "$@" ;;
  esac
}

if ! exists; then
  IMAGE_BUILDER=$builder scripts/image.sh build
fi

port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m enginesim --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
sim=$!
trap 'kill "$sim" 2>/dev/null || true; wait "$sim" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do
  if "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
    break
  fi
  kill -0 "$sim" 2>/dev/null || { echo "the simulator exited:"; cat "$log"; exit 1; }
  sleep 0.2
done

engine="http://127.0.0.1:$port"
echo "smoke: $IMAGE with $builder against the simulator at $engine"
settings=("ENGINE_URL=$engine" ADMISSION_OBSERVE_MODELS=sim-model)
if [ "$builder" = buildah ]; then
  in_image env "${settings[@]}" extproc check-config >/dev/null
  in_image env "${settings[@]}" extproc check "$engine"
else
  in_image -e "${settings[0]}" -e "${settings[1]}" "$IMAGE" extproc check-config >/dev/null
  in_image -e "${settings[0]}" -e "${settings[1]}" "$IMAGE" extproc check "$engine"
fi
echo "smoke: ok"
