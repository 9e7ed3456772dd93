"""Writes the layout search guide's pictures (needs matplotlib): python docs/img/make_search_figures.py"""

import shutil
import tempfile
from pathlib import Path

from meshax.cli import main

HERE = Path(__file__).parent

with tempfile.TemporaryDirectory() as tmp:
    main(
        [
            "plan",
            "lm",
            "--mesh",
            "rows:2;cols:4",
            "--search",
            "--top",
            "5",
            "--picture",
            tmp,
        ]
    )
    shutil.copy(Path(tmp) / "search.png", HERE / "search-chart.png")
    shutil.copy(
        Path(tmp) / "transformer.decoder.0.self_attention.q.png",
        HERE / "search-layout.png",
    )
