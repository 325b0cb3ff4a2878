"""The SSD tier's on-disk layout: ``<stem>.bin`` (the payload) + ``<stem>.meta`` (the serialized ObjectMeta).

Why two files: the ``.meta`` is renamed into place only after the ``.bin`` is complete, so a torn write never
looks like an object, and a restarted node re-adopts exactly the pairs that are whole (``adopt``). The file
name is derived from the key (``ssd_file_stem``); the real key lives in the ``.meta``, so a name is never
parsed back. Plain blocking file I/O: the object store calls the writers and readers from worker threads.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from kvpool.proto import common_pb2

SUFFIXES = (".meta", ".bin")  # removal order: the .meta first, so a half-removed pair is never adopted


def ssd_file_stem(key: bytes) -> str:
    """File name of a key's SSD copy: its hex when short, else a 160-bit digest (names are capped at 255
    bytes; keys at 1024). The ``.meta`` file holds the real key, so the name is never parsed back."""
    if len(key) <= 100:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=20).hexdigest()


def write_files(base: Path, data: memoryview, meta: bytes) -> None:
    """``.bin`` first, then the ``.meta`` renamed into place: a torn write never looks like an object."""
    with base.with_suffix(".bin").open("wb") as f:
        f.write(data)
    tmp = base.with_suffix(".meta.tmp")
    tmp.write_bytes(meta)
    os.replace(tmp, base.with_suffix(".meta"))


def remove_files(base: Path) -> None:
    for suffix in SUFFIXES:
        base.with_suffix(suffix).unlink(missing_ok=True)


def read_file_into(path: Path, view: memoryview) -> int:
    with path.open("rb") as f:
        return f.readinto(view)


def adopt(directory: Path) -> Iterator[tuple[common_pb2.ObjectMeta, Path]]:
    """Every complete pair in ``directory``: its meta (tier SSD) and its data file. A torn or unreadable
    ``.meta``, or a ``.bin`` of the wrong size, is skipped: that object is simply not adopted."""
    for meta_file in sorted(directory.glob("*.meta")):
        data_file = meta_file.with_suffix(".bin")
        meta = common_pb2.ObjectMeta()
        try:
            meta.ParseFromString(meta_file.read_bytes())
        except Exception:
            continue
        if not data_file.exists() or data_file.stat().st_size != meta.size:
            continue
        meta.tier = common_pb2.SSD
        yield meta, data_file
