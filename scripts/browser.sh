#!/usr/bin/env bash
# The headless browser the report test drives: Chromium and its WebDriver from Debian's packages.
#
#   scripts/browser.sh install   install chromium + chromium-driver with apt-get when missing
#   scripts/browser.sh check     exit 0 when both are on PATH, 1 otherwise
#
# Tolerant by design (a Makefile prerequisite of `make test`): when it cannot install (not root, no
# apt-get, no network) it says why and exits 0, and tests/web skips with that reason.
# It never edits the machine's apt or dpkg configuration: a broken apt is reported, not repaired.
set -uo pipefail

log() { echo "browser.sh: $*" >&2; }

have_browser() {
  command -v chromedriver >/dev/null && { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }
}

install() {
  if have_browser; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    log "chromium/chromium-driver missing and not root: run 'apt-get install chromium chromium-driver' (tests/web will skip)"
    return 0
  fi
  command -v apt-get >/dev/null || { log "no apt-get on this machine (tests/web will skip)"; return 0; }
  log "apt-get install chromium chromium-driver"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core >/dev/null; }; then
    log "apt-get failed (tests/web will skip)"
  fi
  return 0
}

case "${1:-install}" in
  install) install ;;
  check) have_browser ;;
  *) sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
