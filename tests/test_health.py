"""The step deadline, the choice of the ranks a stuck step waits on, stragglers, and a
survivor released from a silent peer (raylm.runtime.health), without Ray: functions of
the run's step times and the ranks' reports, and real sockets."""

from __future__ import annotations

import socket
import threading

from raylm.runtime.health import StepDeadline, Stragglers, behind, describe_doing, \
    local_endpoints, release_sockets


def test_the_deadline_is_the_floor_until_steps_are_measured():
    d = StepDeadline(factor=10, floor_s=60)
    assert d.limit() == 60
    for _ in range(5):
        d.add(0.1)
    assert d.limit() == 60  # 10 x 0.1 s is below the floor


def test_the_deadline_follows_the_recent_median_as_steps_slow_down():
    d = StepDeadline(factor=10, floor_s=1, window=4)
    for t in (0.2, 0.2, 0.2, 0.2):
        d.add(t)
    assert d.limit() == 2.0
    # Steps slow down for real (a slower phase): the median, and the deadline, follow;
    # a single slow step moves neither.
    d.add(5.0)
    assert d.limit() == 2.0
    for t in (3.0, 3.0, 3.0):
        d.add(t)
    assert d.limit() == 30.0


def test_the_ranks_furthest_behind_in_a_step_are_the_ones_waited_on():
    doings = [(5, 1, "forward and backward"), (5, 0, "data"), (5, 1, "forward and backward")]
    assert behind(doings) == [1]
    assert behind([(4, 4, "optimizer step"), (5, 0, "data")]) == [0]
    # All in the same place (stuck in one collective): none is behind another.
    assert behind([(5, 1, "a"), (5, 1, "b")]) == [0, 1]


def test_what_a_rank_did_reads_as_words():
    assert describe_doing((5, 1, "forward and backward")) == "step 5: forward and backward"
    assert describe_doing((4, -1, "evaluating")) == "evaluating"


def test_a_rank_slower_than_its_peers_step_after_step_is_a_straggler():
    s = Stragglers(factor=2, steps=3)
    peers = [0, 0, 0]
    for step in range(2):
        worst, behind_s, persistent = s.observe([0.1, 0.35, 0.1], peers)
        assert (worst, round(behind_s, 9), persistent) == (1, 0.25, [])
    worst, behind_s, persistent = s.observe([0.1, 0.35, 0.1], peers)
    assert (worst, persistent) == (1, [(1, 0.1)])
    # A step at par ends the streak: named again only after 3 more slow steps.
    s.observe([0.1, 0.1, 0.1], peers)
    assert s.observe([0.1, 0.35, 0.1], peers)[2] == []


def test_ranks_are_compared_with_their_peers_only():
    """Two pipeline stages of different cost, each with 2 data-parallel replicas: the
    heavier stage is not slow; a replica twice as slow as its own peer is."""
    s = Stragglers(factor=1.5, steps=1)
    peers = ["stage0", "stage0", "stage1", "stage1"]
    assert s.observe([0.1, 0.1, 0.3, 0.3], peers)[2] == []
    worst, _, persistent = s.observe([0.1, 0.1, 0.3, 0.6], peers)
    assert worst == 3 and persistent == [(3, 0.3)]
    # A rank with no peer (dp = 1) is compared with nobody.
    assert Stragglers(1.5, 1).observe([0.1, 0.9], ["a", "b"]) == (None, 0.0, [])


def test_a_survivor_blocked_on_a_silent_peer_is_released_by_its_own_side():
    """A thread blocked reading from a peer that never answers (frozen, or cut off) is
    released when this process shuts down its sockets to that peer (as the peer's
    heartbeat reported its sockets); its connection to another peer, and the listener,
    stay open."""
    listener = socket.create_server(("127.0.0.1", 0))
    silent = socket.create_connection(listener.getsockname())
    other = socket.create_connection(listener.getsockname())
    ours_to_silent, _ = listener.accept()
    ours_to_other, _ = listener.accept()
    got = []
    reader = threading.Thread(target=lambda: got.append(ours_to_silent.recv(1)),
                              daemon=True)
    reader.start()
    reported = {(silent.getsockname(), silent.getpeername())}  # the silent peer's
    assert reported <= local_endpoints()
    assert release_sockets(reported) == 1
    reader.join(timeout=5)
    assert not reader.is_alive() and got == [b""]
    other.sendall(b"x")
    assert ours_to_other.recv(1) == b"x"  # untouched
    assert (listener.getsockname(), None) in local_endpoints()  # (still listening)
    for s in (listener, silent, other, ours_to_silent, ours_to_other):
        s.close()


def test_a_connection_from_the_same_port_number_to_another_peer_is_kept():
    """On one host, two processes' connections to different peers may leave from the
    same local port. Releasing a lost peer shuts the connection that mirrors one of its
    own, not another process's connection that happens to come from the same port."""
    gloo, grpc = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    clients = []
    for server in (gloo, grpc):  # the lost peer's, then another process's, from one port
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        c.bind(("127.0.0.1", clients[0].getsockname()[1] if clients else 0))
        c.connect(server.getsockname())
        clients.append(c)
    lost, bystander = clients
    assert lost.getsockname() == bystander.getsockname()
    from_lost, from_bystander = gloo.accept()[0], grpc.accept()[0]
    assert release_sockets({(lost.getsockname(), lost.getpeername())}) == 1
    assert from_lost.recv(1) == b""  # shut down
    bystander.sendall(b"x")
    assert from_bystander.recv(1) == b"x"  # untouched: before, it was shut too
    for s in (gloo, grpc, lost, bystander, from_lost, from_bystander):
        s.close()
