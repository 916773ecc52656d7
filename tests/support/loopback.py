"""Loopback only: the environment that keeps vLLM on 127.0.0.1, off the hub and without usage stats
(the engine and connector tiers set it for their process and the processes they start), and loopback
"pod IPs" for the engine tier, distinct across the modules of a process and across concurrent runs.

Importing this module changes nothing: the environment is the caller's to apply, and an address block
is claimed on the first loopback_ip()."""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

# vLLM's get_ip() would otherwise probe a route with a UDP socket to a public address; tiny models are
# local directories, so a missing file must fail, not download.
LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

_BLOCKS = Path(tempfile.gettempdir()) / "omnistage-engine-blocks"
_HELD: list[Any] = []  # the claimed block's lock, held for the life of this process (and its children)


def _claim_block() -> int:
    """One of 50 address blocks that no other process on this machine holds: a lock file, held until
    the process ends. The pid modulo 50 alone would let two concurrent runs share one (make test's
    engine tier beside its negative controls: EADDRINUSE on a head's master port)."""
    _BLOCKS.mkdir(exist_ok=True)
    for k in range(50):
        n = (os.getpid() + k) % 50
        f = open(_BLOCKS / f"{n}.lock", "w")  # noqa: SIM115 -- held open for the life of the process
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _HELD.append(f)
        return n
    raise RuntimeError(f"all 50 engine-tier address blocks are held ({_BLOCKS}): 50 engine-tier runs at once?")


def _loopback_addresses():
    """Loopback "pod IPs" (any 127/8 address binds on Linux without configuration), one sequence for
    every module of this process, so no two of them hand out the same address; a /16 (127.76) no
    cluster test uses, four /24 blocks per process, claimed, so parallel runs never meet."""
    first = _claim_block() * 4 + 1
    for i in itertools.count():
        yield f"127.76.{first + i // 254}.{i % 254 + 1}"


_LOOPBACK = _loopback_addresses()


def loopback_ip() -> str:
    return next(_LOOPBACK)
