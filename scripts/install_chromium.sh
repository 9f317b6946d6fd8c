#!/usr/bin/env bash
# Installs headless-capable Chromium (/usr/bin/chromium) for the dashboard browser tests.
# Idempotent (does nothing when it is there) and quiet (output only on failure). Needs root:
# CI runs it as root; elsewhere it re-runs itself with `sudo -n` when that works.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    exec sudo -n bash "$0" "$@"
  fi
  echo "install_chromium.sh: must run as root (apt-get install chromium)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium.sh: no apt-get here; install Chromium as /usr/bin/chromium by hand" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# Recommended packages included: they bring the fonts the screenshots are drawn with.
if ! { apt-get update -qq && apt-get install -y -qq chromium; } >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "install_chromium.sh: apt-get install chromium failed (log above)" >&2
  exit 1
fi
if ! /usr/bin/chromium --headless --no-sandbox --disable-gpu --dump-dom about:blank \
    >/dev/null 2>"$log"; then
  tail -n 30 "$log" >&2
  echo "install_chromium.sh: chromium is installed but does not start headless" >&2
  exit 1
fi
