"""Reading back what a run logged to wandb offline: wandb ships no Python reader of its offline log, so a history item
is looked up as its protobuf bytes (a HistoryItem: the key as field 2, its JSON value as field 16)."""

import json
import time
from pathlib import Path


def offline_run(output_dir: Path, settle_s: float = 1.0, timeout_s: float = 60.0, runs: int = 1) -> bytes:
    """The log of the offline run under <output_dir>/wandb (of its `runs` files, one per start, joined), once its size
    has held for settle_s: wandb's service process can still be writing the last history items when wandb.finish()
    returns (seen on a loaded 2-core machine: a run's last metrics record missing, present a moment later)."""
    files = sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == runs, files
    size, since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = sum(f.stat().st_size for f in files)
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.1)
    return b"".join(f.read_bytes() for f in files)


def logged(run: bytes, key: str, value) -> bool:
    """Whether the run's history holds `key` = `value` (wandb writes an integral float as an integer)."""
    texts = {json.dumps(value)}
    if isinstance(value, float) and value.is_integer():
        texts.add(json.dumps(int(value)))
    name = key.encode()
    return any(bytes([0x12, len(name)]) + name + b"\x82\x01" + bytes([len(t)]) + t.encode() in run for t in texts)
