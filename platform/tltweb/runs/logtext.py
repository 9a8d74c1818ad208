"""A job's log as a person wants to read it: no ANSI codes, one line per tqdm bar, the tail.

Ray job logs are the driver's raw stdout/stderr: colour codes from Ray's own logging, and tqdm
bars that redraw themselves with carriage returns (`\\r`), so one bar of 300 updates is 300 copies
of itself on one "line" (or on many lines when a pipe turned each redraw into a newline).

    clean = log_clean(raw)               # what the run page shows and the download holds
    tail = log_tail(clean, lines=200)    # the last lines
"""

from __future__ import annotations

import re

# CSI sequences (colours, cursor moves: ESC [ ... final byte), OSC (ESC ] ... BEL or ESC \\),
# and the two-byte escapes (ESC + one of @-Z \\ ] ^ _).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# A tqdm bar: "<prefix>: 40%|####      | 120/300 [00:12<00:18, 9.8step/s]" (prefix may be empty).
_TQDM = re.compile(r"^(?P<prefix>.*?)\s*\d{1,3}%\|[^|]*\|\s*\d+(?:\.\d+)?[kMG]?/")


def _bar_key(line: str) -> str | None:
    """The bar's identity (its prefix, e.g. "(pid=12) sft:") when `line` is a tqdm bar."""
    match = _TQDM.match(line)
    return match.group("prefix").strip() if match else None


def log_clean(text: str) -> str:
    """Strip ANSI codes and collapse each tqdm bar's redraws into its latest state."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    out: list[str] = []
    last_key: str | None = None
    for raw in text.split("\n"):
        # A carriage return redraws the line: what is left after the last non-empty redraw shows.
        parts = [p for p in raw.split("\r") if p.strip()]
        line = parts[-1].rstrip() if parts else raw.replace("\r", "").rstrip()
        key = _bar_key(line)
        if key is not None and key == last_key and out:
            out[-1] = line  # the same bar again on a new line (a pipe turned \r into \n)
            continue
        out.append(line)
        last_key = key
    return "\n".join(out).strip("\n") + ("\n" if out and any(out) else "")


def log_tail(text: str, *, lines: int = 200, chars: int = 16_000) -> str:
    """The last `lines` lines of `text` (at most `chars` characters, cut at a line start)."""
    tail = "\n".join(text.rstrip("\n").split("\n")[-lines:])
    if len(tail) > chars:
        tail = tail[-chars:]
        tail = tail[tail.find("\n") + 1:] if "\n" in tail else tail
    return tail
