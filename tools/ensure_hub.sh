#!/usr/bin/env bash
# Make sure JupyterHub's proxy, configurable-http-proxy, is installed for tests/test_hub.py.
#
# `make test` runs this before pytest, as it runs ensure_chromium.sh. jupyterhub itself is a
# Python package (constraints.txt pins it; make install puts it in .venv); its proxy is a
# Node.js program from npm. When it is missing, or another version, and we are root (CI), this
# installs the pinned version globally with npm, as JupyterHub's documentation does (about
# 5 s; into npm's prefix, e.g. /usr/bin/configurable-http-proxy). It needs Node.js 20 or newer
# and npm (Debian 12's own nodejs is 18, too old for it): it says so when they are missing.
#
# It always exits 0, so one missing tool does not stop the other tests: the hub test then
# skips (not root) or fails (root, yet still missing) with the same advice.
set -u
VERSION=5.3.0
say() { echo "ensure_hub: $*" >&2; }

if [ "$(configurable-http-proxy --version 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    say "configurable-http-proxy $VERSION is missing, and installing it needs root. Install it with:"
    say "    sudo npm install -g configurable-http-proxy@$VERSION"
    exit 0
fi
if ! command -v npm >/dev/null; then
    say "configurable-http-proxy $VERSION is missing, and so is npm: install Node.js 20 or newer with npm,"
    say "then run: npm install -g configurable-http-proxy@$VERSION"
    exit 0
fi
say "installing configurable-http-proxy@$VERSION with npm."
if ! npm install -g --no-fund --no-audit "configurable-http-proxy@$VERSION"; then
    say "npm install -g configurable-http-proxy@$VERSION failed (see above)."
elif [ "$(configurable-http-proxy --version 2>/dev/null)" != "$VERSION" ]; then
    say "installed, but \`configurable-http-proxy --version\` on PATH does not say $VERSION."
fi
exit 0
