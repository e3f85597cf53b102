#!/usr/bin/env bash
# System packages the tests use beyond PyPI, from Debian:
# - `prometheus` (prometheus + promtool) for the alert-rule and live observability tests;
# - `redis-server` for the shared ledger's unit, property and integration tests;
# - `chromium` (headless) for the status page test, which renders the page in a real browser;
# - `wrk` for `python -m bench.hotpath` and its smoke test (tests/bench/test_hotpath.py).
# Installed when missing and apt-get is usable (root); otherwise those tests skip with a reason
# (and fail under CI=true).
set -euo pipefail
missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "note: ${missing[*]} not found and cannot apt-get install them here;" \
       "the tests that need them will skip (install the Debian packages to run them)" >&2
fi
