"""How every chart is saved: a 32-colour palette PNG, about a quarter of matplotlib's RGBA file and alike to the eye."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path, dpi: int = 90) -> None:
    """Save a matplotlib figure to ``path`` as a palette PNG, and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    save_palette(buf.getvalue(), path)


def save_palette(png: bytes, path: Path) -> None:
    """Save a PNG's bytes (e.g. a chart another tool drew, kept with the results) to ``path`` as a palette PNG."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(io.BytesIO(png)) as image:
        small = image.convert("RGB").quantize(colors=32, method=Image.Quantize.MEDIANCUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    small.save(path, "PNG", optimize=True)
