#!/usr/bin/env bash
# Test fixtures that are downloaded, not committed: octokit's recorded GitHub webhook deliveries.
#
#   scripts/fixtures.sh fetch     download and verify them into <repo>/.fixtures (once)
#   scripts/fixtures.sh path      print the examples file (api.github.com/index.json)
#   scripts/fixtures.sh check     verify what is there; exit 1 if absent or altered
#
# Package @octokit/webhooks-examples, pinned to one version and to the sha512 the npm registry
# publishes for it (`npm view @octokit/webhooks-examples@VERSION dist.integrity`): a tarball with
# another digest is refused, never unpacked. Downloaded with `npm pack` when npm is on PATH, else
# with curl from the registry. Directory: $RUNLEDGER_FIXTURES_DIR, else <repo>/.fixtures.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${RUNLEDGER_FIXTURES_DIR:-$ROOT/.fixtures}"
PACKAGE="@octokit/webhooks-examples"
VERSION="7.6.1"
INTEGRITY="sha512-De6U3XB6O3DtCa7bKgCMzTHdeopqqZ6SNivMYJnK65ierKL1AnNIA0tkRYCRS7lwGT792d+Ps1WbfHlso6MynQ=="
TARBALL_URL="https://registry.npmjs.org/@octokit/webhooks-examples/-/webhooks-examples-$VERSION.tgz"
TGZ="$DIR/octokit-webhooks-examples-$VERSION.tgz"
OUT="$DIR/octokit-webhooks-examples-$VERSION"
EXAMPLES="$OUT/api.github.com/index.json"

log() { echo "fixtures.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

integrity_of() { # the npm "sha512-<base64>" form of a file's digest
  printf 'sha512-%s' "$(openssl dgst -sha512 -binary "$1" | base64 | tr -d '\n')"
}

verified() { [ -f "$TGZ" ] && [ "$(integrity_of "$TGZ")" = "$INTEGRITY" ]; }

download() {
  local tmp
  tmp="$(mktemp -d "$DIR/.fetch.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  if command -v npm >/dev/null; then
    log "npm pack $PACKAGE@$VERSION into $DIR"
    (cd "$tmp" && npm pack --silent "$PACKAGE@$VERSION" >/dev/null) || die "npm pack $PACKAGE@$VERSION failed"
    mv "$tmp"/octokit-webhooks-examples-"$VERSION".tgz "$tmp/download.tgz" 2>/dev/null ||
      die "npm pack did not write octokit-webhooks-examples-$VERSION.tgz"
  else
    command -v curl >/dev/null || die "neither npm nor curl on PATH (needed once to download $PACKAGE)"
    log "curl $TARBALL_URL"
    curl -fsSL --retry 3 -o "$tmp/download.tgz" "$TARBALL_URL" || die "could not download $TARBALL_URL"
  fi
  local got
  got="$(integrity_of "$tmp/download.tgz")"
  [ "$got" = "$INTEGRITY" ] || die "$PACKAGE@$VERSION has integrity $got, expected the pinned $INTEGRITY"
  mv "$tmp/download.tgz" "$TGZ"
  rm -rf "$tmp"
  trap - EXIT
}

unpack() {
  local tmp
  tmp="$(mktemp -d "$DIR/.unpack.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  tar -xzf "$TGZ" -C "$tmp"
  [ -f "$tmp/package/api.github.com/index.json" ] || die "$TGZ has no api.github.com/index.json"
  rm -rf "$OUT"
  mv "$tmp/package" "$OUT"
  rm -rf "$tmp"
  trap - EXIT
}

do_fetch() {
  mkdir -p "$DIR"
  if ! verified; then
    rm -f "$TGZ"
    download
  fi
  # Unpacked from the verified tarball whenever the unpacked copy is missing.
  if [ ! -f "$EXAMPLES" ]; then
    unpack
  fi
  echo "$EXAMPLES"
}

do_check() {
  verified || die "$TGZ is absent or does not match the pinned integrity (run: scripts/fixtures.sh fetch)"
  [ -f "$EXAMPLES" ] || die "$EXAMPLES is absent (run: scripts/fixtures.sh fetch)"
  echo "$EXAMPLES"
}

case "${1:-}" in
  fetch) do_fetch ;;
  check) do_check ;;
  path) echo "$EXAMPLES" ;;
  -h|--help|"") usage ;;
  *) die "unknown command: $1" ;;
esac
