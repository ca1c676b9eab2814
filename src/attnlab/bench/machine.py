"""What the machine was doing while a benchmark ran: printed beside the figures it qualifies."""

from __future__ import annotations

import os


def load_average() -> str:
    """The 1/5/15-minute load averages: a timing means little without the machine's load beside it."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
