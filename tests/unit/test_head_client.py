"""head_client's failure messages end up in conditions and Events: they must not change per call."""

from __future__ import annotations

import socket

import pytest
from omnistage import head_client
from omnistage.head_client import HeadClient, HeadUnreachable


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_unreachable_head_message_is_stable():
    head = HeadClient("127.0.0.1", _free_loopback_port(), "token")
    messages = set()
    for _ in range(2):
        with pytest.raises(HeadUnreachable) as err:
            head_client.report(head, attempts=1)
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    (message,) = messages
    assert "no answer" in message and " at 0x" not in message
