#!/usr/bin/env bash
# Make sure bubblewrap (bwrap) is installed: `ddplab grade` runs each submission in it.
#
# `make test` runs this before pytest. When bwrap is missing and we are root on a
# Debian-like machine (CI), it installs Debian's `bubblewrap` package with apt-get
# (a few seconds, under 200 kB). It never fetches a sandbox any other way.
#
# It always exits 0, so one missing tool does not stop the other tests: when it
# cannot install, it says why, and tests/test_grade_hostile.py, which requires
# the sandbox, then fails with the same advice. Grading itself still runs without
# it, and says so in one line when it starts.
set -u
say() { echo "ensure_sandbox: $*" >&2; }

if command -v bwrap >/dev/null; then
    if ! bwrap --unshare-user --unshare-pid --ro-bind / / true 2>/dev/null; then
        say "bwrap is installed but cannot make a sandbox here (unprivileged user namespaces off?):"
        say "    sysctl kernel.unprivileged_userns_clone=1   # Debian; or run in a VM/container that allows them"
    fi
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    say "bwrap is missing, and installing it needs root. Install it with:"
    say "    sudo apt-get update && sudo apt-get install -y bubblewrap"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "bwrap is missing and this machine has no apt-get (not Debian-like): install bubblewrap."
    exit 0
fi
say "bwrap is missing: installing Debian's bubblewrap package with apt-get."
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -q; then
    say "apt-get update failed (see above); cannot install bubblewrap."
elif ! apt-get install -y -q bubblewrap; then
    say "apt-get install bubblewrap failed (see above)."
else
    say "installed $(bwrap --version 2>/dev/null)."
fi
exit 0
