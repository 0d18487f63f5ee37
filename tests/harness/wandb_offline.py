"""Read back an offline W&B run without network: its metrics and the artifacts it logged.

wandb 0.31 no longer ships a Python reader of its ``run-<id>.wandb`` files (``wandb.sdk.internal.datastore``
is gone) and ``wandb.Api`` needs a server, so this parses the file: a LevelDB-log framed stream (a
7-byte header ``:W&B`` + 0xBEE1 + version, 32 KiB blocks, records ``<crc32:u32><len:u16><type:u8><data>``
with FULL=1, FIRST=2, MIDDLE=3, LAST=4) of ``wandb.proto.wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = 7
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CRC = {kind: zlib.crc32(bytes([kind])) & 0xFFFFFFFF for kind in (FULL, FIRST, MIDDLE, LAST)}


def _payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    position, pending = HEADER, bytearray()
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        if kind == 0 and length == 0:
            position += left
            continue
        body = data[position + HEADER:position + HEADER + length]
        if len(body) < length:
            return
        assert zlib.crc32(body, _CRC[kind]) & 0xFFFFFFFF == checksum, f"bad checksum at {position} in {path}"
        position += HEADER + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = bytearray(body)
        else:
            pending += body
            if kind == LAST:
                yield bytes(pending)


def records(run_dir: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for payload in _payloads(next(run_dir.glob("run-*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def finished(run_dir: Path, timeout_s: float = 30.0) -> Path:
    """``run_dir`` once its run file holds the exit record, or after ``timeout_s``: the W&B service may still be
    writing the file when ``wandb.finish()`` returns (a run read at once in a busy CI had no history at all)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(record.WhichOneof("record_type") == "exit" for record in records(run_dir)):
                break
        except (StopIteration, AssertionError, struct.error):  # no file yet, or its header not written
            pass
        time.sleep(0.1)
    return run_dir


def metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(trainer/global_step, value)] of every history row (Lightning's WandbLogger logs the step there)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.get("trainer/global_step", items.get("_step", -1)))
        for key, value in items.items():
            if not key.startswith("_") and key != "trainer/global_step":
                out.setdefault(key, []).append((step, value))
    return out


def artifacts(run_dir: Path) -> list[dict[str, Any]]:
    """The artifacts the run logged: name, type and the files of their manifest."""
    return [{"name": record.artifact.name, "type": record.artifact.type,
             "files": sorted(entry.path for entry in record.artifact.manifest.contents)}
            for record in records(run_dir) if record.WhichOneof("record_type") == "artifact"]
