#!/usr/bin/env bash
# Make sure the real daemons of tests/test_realhosts_*.py are here: Debian's sshd, Slurm (with
# munge) and Open MPI, and mpi4py for the venv's Python.
#
# `make test` runs this before pytest, as it runs ensure_chromium.sh. When something is
# missing and we are root on a Debian-like machine (CI), it installs it with apt-get
# (openssh-server openssh-client slurm-wlm munge openmpi-bin libopenmpi-dev; about a
# minute on a fresh Debian 12), and mpi4py into $PYTHON's environment with pip (built
# against Debian's Open MPI). Debian's python3-mpi4py is built for /usr/bin/python3 only,
# so a venv cannot use it.
#
#   bash tools/ensure_hosts.sh [PYTHON]     # PYTHON defaults to .venv/bin/python
#
# It always exits 0, so one missing daemon does not stop the other tests: the realhosts
# tier then skips (not root) or fails (root, yet still missing) with the same advice.
set -u
PYTHON=${1:-.venv/bin/python}
say() { echo "ensure_hosts: $*" >&2; }

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null || missing+=(slurm-wlm)
[ -x /usr/sbin/munged ] || missing+=(munge)
command -v mpiexec >/dev/null || missing+=(openmpi-bin)
command -v mpicc >/dev/null || missing+=(libopenmpi-dev)     # mpi4py builds against it

if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        say "missing ${missing[*]}, and installing needs root. Install them with:"
        say "    sudo apt-get update && sudo apt-get install -y ${missing[*]}"
    elif ! command -v apt-get >/dev/null; then
        say "missing ${missing[*]} and this machine has no apt-get (not Debian-like): install them."
    else
        say "missing ${missing[*]}: installing Debian's packages with apt-get."
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get update -q; then
            say "apt-get update failed (see above)."
        elif ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
            say "apt-get install ${missing[*]} failed (see above)."
        fi
        # The packages start their daemons where systemd runs; the tests start their own.
    fi
fi

if [ -x "$PYTHON" ] && ! "$PYTHON" -c "import mpi4py" 2>/dev/null; then
    if command -v mpicc >/dev/null; then
        say "mpi4py is missing from $PYTHON: installing it with pip (builds against Open MPI)."
        "$PYTHON" -m pip install --quiet -c "$(dirname "$0")/../constraints.txt" mpi4py || say "pip install mpi4py failed (see above)."
    else
        say "mpi4py is missing from $PYTHON, and Open MPI's mpicc too: install libopenmpi-dev first."
    fi
fi
exit 0
