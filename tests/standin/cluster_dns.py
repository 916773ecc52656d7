"""The cluster DNS names engine processes resolve, as this machine's /etc/hosts holds them.

A cluster's DNS answers NAME-master.NAMESPACE.svc (a headless Service that publishes not-ready
addresses) with the IP of every pod its selector picks: the OmniStage's serving head. A replica's
engine looks its head up there when the address it registered with stopped answering (the head pod
was replaced: engine patch reattach). Real engine processes of this runtime have no cluster DNS,
so the runtime keeps a block of /etc/hosts lines, one per serving head pod, marked with its own pid:
written when a head pod gets an IP or changes, removed when the runtime stops; a block of a runtime
that died is removed by the next one. Every address is loopback (the network rule).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path
from typing import Any

HOSTS = Path(os.environ.get("OMNISTAGE_STANDIN_HOSTS", "/etc/hosts"))
MARK = "# omnistage-standin"
_OWNER = re.compile(rf"{MARK} (\d+)-(\w+)$")
_lock = threading.Lock()


def names(pods: dict[tuple[str, str], dict[str, Any]], omnistage_label: str, role_label: str,
          head_role: str) -> dict[str, str]:
    """{DNS name: IP} of every master Service: the pods its selector picks (role head), by name."""
    out: dict[str, str] = {}
    for (ns, _), pod in sorted(pods.items()):
        labels = pod["metadata"].get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if labels.get(role_label) != head_role or not labels.get(omnistage_label) or not ip \
                or pod["metadata"].get("deletionTimestamp"):
            continue
        service = f"{labels[omnistage_label]}-master.{ns}.svc"
        out[service] = ip
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write(entries: dict[str, str], runtime: str) -> bool:
    """Replace the block of `runtime` (a name unique in this process) and any dead process's with
    `entries`; False when the file cannot be written (then the names do not resolve, and a test that
    needs them fails saying so)."""
    owner = f"{os.getpid()}-{runtime}"
    with _lock:
        try:
            lines = HOSTS.read_text().splitlines()
        except OSError:
            return False
        kept = [ln for ln in lines if not ((m := _OWNER.search(ln)) and
                                           (f"{m.group(1)}-{m.group(2)}" == owner or not _alive(int(m.group(1)))))]
        ours = [f"{ip} {name} {name}.cluster.local {MARK} {owner}" for name, ip in sorted(entries.items())]
        text = "\n".join(kept + ours) + "\n"
        with contextlib.suppress(OSError):
            if HOSTS.read_text() == text:
                return True
        try:
            # In place (not a rename): a bind mount of this file, as containers use, keeps seeing it.
            with open(HOSTS, "r+") as f:
                f.seek(0)
                f.write(text)
                f.truncate()
        except OSError:
            return False
    return True
