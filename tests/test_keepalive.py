"""What a captured graph reads at replay is kept with the graph that reads it (on a
GPU: tests/test_fuse_gpu.py, the own AdamW kernel's tables under sg.static)."""

from __future__ import annotations

from sgraph._src.runtime import keepalive


def test_objects_go_to_the_capture_holding_them_else_to_the_process():
    kept: list = []
    marker, other = object(), object()
    with keepalive.kept_with(kept):
        keepalive.keep_for_replays(marker)
    assert kept == [marker]
    before = len(keepalive._PROCESS)
    keepalive.keep_for_replays(other)
    try:
        assert keepalive._PROCESS[before:] == [other] and kept == [marker]
    finally:
        del keepalive._PROCESS[before:]
