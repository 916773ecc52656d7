"""The membership port's connection book (``membership_connections.Book``, issue 40 item 3): whom a
new connection is refused to, and whom it closes when too many wait. Over loopback with the real
server: tests/engine/test_membership_port_connections.py."""

from __future__ import annotations

from omnistage_engine_patches import membership_connections as mc


class Conn:
    """A connection as the book sees it: its peer, and itself (hashed by identity)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer


def admitted(book: mc.Book, peer: str) -> Conn | None:
    c = Conn(peer)
    if not book.admit(c):
        return None
    book.set_waiting(c, True)
    return c


def test_a_peer_past_its_cap_is_refused_and_others_are_not():
    book = mc.Book()
    mine = [admitted(book, "10.0.0.9") for _ in range(mc.MAX_PER_PEER)]
    assert all(mine) and admitted(book, "10.0.0.9") is None
    assert admitted(book, "10.0.0.1") is not None  # the operator: another address
    book.forget(mine[0])
    assert admitted(book, "10.0.0.9") is not None  # a closed one frees its place
    assert book.per_peer["10.0.0.9"] == mc.MAX_PER_PEER


def test_past_max_waiting_the_largest_peers_oldest_goes_never_the_newcomer():
    book = mc.Book()
    peers = [f"10.0.1.{i}" for i in range(mc.MAX_WAITING // mc.MAX_PER_PEER)]
    first = {p: admitted(book, p) for p in peers}
    for p in peers:
        for _ in range(mc.MAX_PER_PEER - 1):
            admitted(book, p)
    assert len(book.waiting) == mc.MAX_WAITING and book.victim(None) is None
    newcomer = admitted(book, "10.0.0.1")
    assert book.victim(newcomer) is first[peers[0]]  # the oldest of the (equally) largest peers
    book.forget(first[peers[0]])
    # The first peer back at its cap: every peer holds as many, and the oldest of them all goes.
    again = admitted(book, peers[0])
    assert book.victim(again) is first[peers[1]]


def test_the_peer_holding_the_most_loses_its_oldest_whoever_is_older_elsewhere():
    book = mc.Book()
    lone = [admitted(book, f"10.0.3.{i}") for i in range(mc.MAX_WAITING - mc.MAX_PER_PEER)]
    crowd = [admitted(book, "10.0.9.9") for _ in range(mc.MAX_PER_PEER)]
    newcomer = admitted(book, "10.0.0.1")
    assert book.victim(newcomer) is crowd[0] and lone[0] in book.waiting


def test_only_waiting_connections_can_be_closed_for_room():
    """A connection whose request is in progress (the operator's leave, draining) is not waiting:
    it never counts towards MAX_WAITING and is never the victim."""
    book = mc.Book()
    busy = admitted(book, "10.0.0.1")
    book.set_waiting(busy, False)
    for i in range(mc.MAX_WAITING + 1):
        last = admitted(book, f"10.0.2.{i}")
    assert book.victim(last) is not busy and book.victim(last) is not None
    assert busy not in book.waiting
