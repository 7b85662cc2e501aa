"""Run a function in spawned processes that form a torch.distributed gloo group (no Ray):
for tests of what one rank builds or holds."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout: float = 180) -> tuple:
    """Run ``target(rank, port, *args, queue)`` in ``world`` spawned processes (``port``:
    a free one for their rendezvous, each putting ``(rank, result)`` on ``queue``);
    returns ({rank: result}, processes), the processes joined (killed if they hang)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results, procs
