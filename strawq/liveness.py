"""Whether a process is known to be gone: the fast path of the liveness judgements.

A writer whose silence matters (a producer's heartbeat, a collector's epoch) records who it
is: host name, boot id, pid namespace and pid (``identity()``). Another process on the same
host, boot and pid namespace can then tell at once that it is gone (``known_dead``): its pid
no longer exists. Anything else — another host, another container's pid namespace, an
unreadable or missing record, a pid that exists (perhaps reused) — is *not known dead*, and
the caller falls back to heartbeat silence. So this path only ever shortens a wait for a
process that is certainly gone; it never judges a live one dead (a reused pid keeps a dead
writer looking alive, which only means the silence path decides).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from strawq.ondisk.records import newest_format

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str:
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def identity() -> dict[str, Any]:
    """This process: ``{"host", "boot", "pidns", "pid", "reads"}``; ``reads`` is the newest
    run format it reads (``strawq.tasks.formats``: ``strawq upgrade`` checks it)."""
    return {"host": socket.gethostname(), "boot": _boot_id(), "pidns": _pid_namespace(),
            "pid": os.getpid(), "reads": newest_format()}


def identity_bytes() -> bytes:
    """``identity()`` as the small JSON body a heartbeat file carries."""
    return json.dumps(identity(), separators=(",", ":")).encode()


def parse_identity(body: bytes) -> dict[str, Any] | None:
    """The identity in a heartbeat file's body; None for an empty or foreign body."""
    if not body:
        return None
    try:
        who = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return who if isinstance(who, dict) else None


def _zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie: it exited and only waits for its parent to reap it
    (``/proc/<pid>/stat`` state ``Z``; ``X``: being reaped). False where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # the command name is in parentheses and may hold spaces or ')': the state follows the last
    head, _, rest = stat.rpartition(b")")
    state = rest.split()[:1]
    return bool(head) and state in ([b"Z"], [b"X"])


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a running process. A zombie (a process that exited but was not
    reaped yet: a collector killed with -9 whose parent has not waited for it) is dead: it
    can never write again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return not _zombie(pid)
    return not _zombie(pid)


def known_dead(who: Mapping[str, Any] | None) -> bool:
    """True only if ``who`` ran on this host, boot and pid namespace and its pid is gone."""
    if not who:
        return False
    pid = who.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if who.get("host") != socket.gethostname():
        return False
    boot, ns = _boot_id(), _pid_namespace()
    if not boot or not ns or who.get("boot") != boot or who.get("pidns") != ns:
        return False
    return not pid_alive(pid)
