"""How every chart is saved: a 32-colour palette PNG, about a quarter of matplotlib's RGBA file and alike to the eye."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["save_figure", "shrink_png"]

COLORS = 32


def shrink_png(png: bytes | Path, path: Path) -> None:
    """Write a PNG (bytes, or a file) to ``path`` with a :data:`COLORS`-colour palette."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(io.BytesIO(png) if isinstance(png, bytes) else png) as image:
        small = image.convert("RGB").quantize(colors=COLORS, method=Image.Quantize.MEDIANCUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    small.save(path, "PNG", optimize=True)


def save_figure(fig: Any, path: Path, dpi: int = 90) -> None:
    """Save a matplotlib figure to ``path`` as a palette PNG, and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    shrink_png(buf.getvalue(), path)
