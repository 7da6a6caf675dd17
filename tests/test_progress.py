"""The progress line of long compiles: shown on a terminal, silent otherwise."""

from __future__ import annotations

import io
import re
import time

from sgraph._src.runtime.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_compile_on_a_terminal_shows_a_line_then_the_total(monkeypatch):
    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    with progress("sg.static(step): generating kernels", delay=0.05):
        time.sleep(1.3)
    text = stream.getvalue()
    assert re.search(r"^\rsg\.static\(step\): generating kernels \.\.\. \ds\r", text), text
    assert re.search(r"\rsg\.static\(step\): generating kernels: done in \d+\.\ds\n$", text), text


def test_short_compiles_and_non_terminals_stay_silent(monkeypatch):
    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    with progress("quick", delay=0.5):
        pass
    assert stream.getvalue() == ""
    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    with progress("logged", delay=0.0):
        time.sleep(0.1)
    assert plain.getvalue() == ""
