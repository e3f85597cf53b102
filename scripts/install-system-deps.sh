#!/usr/bin/env bash
# System packages the tests use beyond PyPI: Debian's `prometheus` (prometheus + promtool) for
# the alert-rule and live observability tests. Installed when missing and apt-get is usable
# (root); otherwise those tests skip with a reason (and fail under CI=true).
set -euo pipefail
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus
else
  echo "note: prometheus/promtool not found and cannot apt-get install them here;" \
       "tests/observability will skip (install Debian's 'prometheus' package to run them)" >&2
fi
