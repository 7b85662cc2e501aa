"""Read what a run sent to TensorBoard and W&B back with their own formats' readers."""

from __future__ import annotations

import glob
import json
import os
import struct


def tensorboard_scalars(logdir: str) -> dict:
    """{tag: {step: value}} as TensorBoard shows them: its own EventAccumulator, which
    also applies the purges a restore wrote (a redone step replaces the one before)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    out = {}
    for name in acc.Tags()["scalars"]:
        events = acc.Scalars(name)
        out[name] = {e.step: e.value for e in events}
        assert len(out[name]) == len(events), f"{name}: a step shown twice"
    return out


def wandb_history(output_dir: str) -> list[dict]:
    """The history rows of the offline W&B run under ``output_dir`` (its .wandb file: a
    7-byte header, then LevelDB log blocks of 32 KiB whose records are cut into chunks
    with a 7-byte header of crc, length and type: 1 full, 2 first, 3 middle, 4 last).
    wandb ships no reader of its own for the file."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
    return rows
