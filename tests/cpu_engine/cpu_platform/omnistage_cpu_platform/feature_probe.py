"""TEST-ONLY vLLM general plugin (`omnistage_feature_probe`): what each engine core computed on.

For every request an engine core admits, one JSON line in `$HOME/omnistage-feature-probe.jsonl`
(the real-mode runtime gives every pod its own HOME): the request id, and per multimodal item its
hash (the cache key), whether the frontend sent the tensors or omitted them for the receiver cache
to fill, and a SHA-256 of the tensors the engine core ended up with. The real-engine tier asserts
on these lines that different media reach a replica as their own features, whichever replica
serves them. Wraps `EngineCore.preprocess_add_request`, where the receiver cache fills omitted
items (vllm-omni's StageEngineCoreProc calls it through super()). Never in an engine image.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

FILE_NAME = "omnistage-feature-probe.jsonl"
_lock = threading.Lock()


def _digest(obj: Any, h: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        for k in sorted(obj.keys(), key=str):
            h.update(str(k).encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _digest(v, h)
    elif hasattr(obj, "data") and not isinstance(obj, (str, bytes)):
        _digest(obj.data, h)  # MultiModalFieldElem
    else:
        h.update(repr(obj).encode())


def digest(item: Any) -> str | None:
    """A probe must never fail a request: a digest it cannot take is recorded as such."""
    if item is None:
        return None
    h = hashlib.sha256()
    try:
        _digest(item, h)
    except Exception as err:  # noqa: BLE001
        return f"error: {type(err).__name__}: {err}"
    return h.hexdigest()[:16]


def install() -> None:
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    if getattr(original, "_omnistage_feature_probe", False):
        return
    path = Path(os.environ.get("HOME", "/tmp")) / FILE_NAME

    @functools.wraps(original)
    def preprocess_add_request(self, request, *args, **kwargs):
        sent = [f.data is not None for f in request.mm_features or []]
        out = original(self, request, *args, **kwargs)
        if request.mm_features:
            try:  # a probe failure must never fail the request
                line = {"pid": os.getpid(), "request": request.request_id,
                        "items": [{"modality": f.modality, "hash": f.identifier, "sent": s, "digest": digest(f.data)}
                                  for f, s in zip(request.mm_features, sent, strict=False)]}
                with _lock, open(path, "a") as fh:
                    fh.write(json.dumps(line) + "\n")
            except Exception as err:  # noqa: BLE001
                print(f"[feature probe] not recorded: {type(err).__name__}: {err}", flush=True)
        return out

    preprocess_add_request._omnistage_feature_probe = True
    EngineCore.preprocess_add_request = preprocess_add_request
