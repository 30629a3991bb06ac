#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for tests/test_browser_*.py.
#
# `make test` runs this before pytest. When the browser is missing and we are
# root on a Debian-like machine (CI), it installs the `chromium` package with
# apt-get (about 30 s and 155 MB on a fresh Debian 12). It never downloads a
# browser any other way.
#
# It always exits 0, so one missing browser does not stop the other tests:
# when it cannot install, it says why, and the browser test, which make test
# requires (DDPLAB_REQUIRE_BROWSER=1), then fails with the same advice.
set -u
CHROMIUM=/usr/bin/chromium
say() { echo "ensure_chromium: $*" >&2; }

if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    say "$CHROMIUM is missing, and installing it needs root. Install it with:"
    say "    sudo apt-get update && sudo apt-get install -y chromium"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "$CHROMIUM is missing and this machine has no apt-get (not Debian-like): install Chromium at $CHROMIUM."
    exit 0
fi
say "$CHROMIUM is missing: installing Debian's chromium package with apt-get."
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -q; then
    say "apt-get update failed (see above); cannot install chromium."
elif ! apt-get install -y -q chromium; then
    say "apt-get install chromium failed (see above)."
elif [ ! -x "$CHROMIUM" ]; then
    say "the chromium package installed, but not at $CHROMIUM (Ubuntu's is a snap wrapper): use Debian's."
else
    say "installed $("$CHROMIUM" --version 2>/dev/null)."
fi
exit 0
