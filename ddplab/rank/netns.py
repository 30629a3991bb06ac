"""A network of the lab's own: the ranks' sockets where no other user can reach them.

gloo does not authenticate its peers, and the ``*_object`` collectives unpickle
what they receive. On a machine shared by a class, a rank listening on
127.0.0.1 is a rank any other user can connect to. So the template that forks
a local lab's ranks (``ddplab.rank.template``) first moves itself into a new
*network namespace*: a network stack of its own, holding only a loopback
interface. Every rank it forks inherits it, so the ranks reach each other on
127.0.0.1 as before (gloo, a TCPStore, torchrun's rendezvous), while from the
rest of the machine there is nothing to connect to: a port bound in there does
not exist outside. The controller talks to the kernel and the engines over
Unix sockets in the lab's private (0700) directory, which a file path, not a
network, reaches (``ddplab.rank.ipc_controller``).

Making a network namespace needs ``CAP_SYS_ADMIN``. root has it; any other
user first makes a *user namespace* (its own uid mapped to itself, so files it
creates belong to it as before), in which it holds that capability over what
it creates, and nothing else. Unprivileged user namespaces are allowed by
default on Debian and most distributions; some (Ubuntu's AppArmor policy,
hardened kernels, containers without ``--privileged``) forbid them. Then the
template stays on the machine's network and the kernel says so in one line
when the lab starts (``reason``).

``DDPLAB_NETNS=0`` keeps the machine's network; ``DDPLAB_NETNS=user`` makes a
user namespace even as root (so tests can run the path other users take).

This must run while the process has a single thread: the kernel refuses
``unshare(CLONE_NEWUSER)`` in a multi-threaded process. The template calls it
first thing, before it imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import os
import socket
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
#: Names for loopback's IPv6 forms. c10d names each peer of a TCPStore with
#: getnameinfo(); a client on 127.0.0.1 appears as ::ffff:127.0.0.1, which many
#: /etc/hosts files do not list, so glibc asks DNS. Outside, DNS answers "no such
#: name" and c10d falls back to the number in silence; in a network without DNS
#: the answer is "try again", and c10d prints a warning under every rank.
_LOOPBACK_NAMES = "::1 localhost\n::ffff:127.0.0.1 localhost\n"
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"          # struct ifreq: the interface's name, then its flags
ENV = "DDPLAB_NETNS"
log = logging.getLogger(__name__)


def enter_private_network(scratch: str) -> str | None:
    """Move this process into a new network namespace with loopback up.

    ``scratch``: a private directory for a moment's file (the hosts file, see
    ``_name_loopback``).

    Returns None once it is done, or why it could not be, as a short phrase
    (the process then stays on the machine's network, unchanged).
    """
    setting = os.environ.get(ENV, "1")
    if setting == "0":
        return f"{ENV}=0 is set"
    as_user = setting == "user" or os.geteuid() != 0
    # Read before unshare: inside a new user namespace, until it is mapped, we are
    # the overflow user (65534).
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS | (CLONE_NEWUSER if as_user else 0)) != 0:
        error = os.strerror(ctypes.get_errno())
        what = "a user and network namespace" if as_user else "a network namespace"
        return f"this machine does not let this user make {what} ({error})"
    try:
        if as_user:
            _map_to_self(uid, gid)
        _loopback_up()
    except OSError as e:
        # Half made: a namespace without loopback would break every rank. There is
        # no way back to the machine's network from here, so say what failed.
        raise RuntimeError(f"ddplab: could not set up the lab's private network: {e}. "
                           f"Set {ENV}=0 to keep the ranks on the machine's network.") from e
    try:
        _name_loopback(libc, scratch)
    except OSError as e:
        # Only cosmetic: without it c10d warns that it cannot name a peer.
        log.warning("ddplab: could not name loopback's IPv6 forms in the lab's network: %s", e)
    return None


def _name_loopback(libc: ctypes.CDLL, scratch: str) -> None:
    """In our own mount namespace, /etc/hosts plus names for ::1 and ::ffff:127.0.0.1."""
    # Private first: a bind mount must not travel back to the machine's namespace.
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "making / private: " + os.strerror(ctypes.get_errno()))
    try:
        with open("/etc/hosts") as f:
            hosts = f.read()
    except OSError:
        hosts = "127.0.0.1 localhost\n"
    path = os.path.join(scratch, "hosts")
    with open(path, "w") as f:
        f.write(hosts.rstrip("\n") + "\n" + _LOOPBACK_NAMES)
    try:
        if libc.mount(path.encode(), b"/etc/hosts", None, _MS_BIND, None) != 0:
            error = ctypes.get_errno()
            raise OSError(error, "bind-mounting /etc/hosts: " + os.strerror(error))
    finally:
        os.unlink(path)                    # the mount keeps the file alive


def _map_to_self(uid: int, gid: int) -> None:
    """Map our uid and gid to themselves in the new user namespace (files stay ours)."""
    # An unprivileged process may write gid_map only after giving up setgroups.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _loopback_up() -> None:
    """A new network namespace starts with ``lo`` down: bring it up (``ip link set lo up``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))

