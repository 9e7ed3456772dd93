"""Writes the site's figures (plain SVG, no dependencies): python docs/img/make_figures.py"""

from pathlib import Path

HERE = Path(__file__).parent
COLORS = [
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
]


def _svg(width: int, height: int, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="13">\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def _grid(x0, y0, rows, cols, w, h, label) -> list[str]:
    """A rows x cols grid of cells, cell (r, c) colored as device r * cols + c."""
    out = []
    for r in range(rows):
        for c in range(cols):
            d = r * cols + c
            x, y = x0 + c * w, y0 + r * h
            out.append(
                f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{COLORS[d]}" stroke="white"/>'
            )
            out.append(
                f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" fill="white" text-anchor="middle">{label(d)}</text>'
            )
    return out


def layout_figure() -> str:
    body = ['<text x="20" y="22" font-weight="bold">mesh "rows:2;cols:4"</text>']
    body += _grid(20, 35, 2, 4, 50, 40, lambda d: f"dev {d}")
    body.append(
        '<text x="10" y="80" text-anchor="end" transform="rotate(-90 12 80)">rows</text>'
    )
    body.append('<text x="120" y="135">cols</text>')
    title = 'tensor [batch=64, hidden=128], layout "batch:rows;hidden:cols"'
    body.append(f'<text x="270" y="22" font-weight="bold">{title}</text>')
    body += _grid(270, 35, 2, 4, 80, 60, lambda d: f"dev {d}")
    body.append(
        '<text x="255" y="95" text-anchor="middle" transform="rotate(-90 255 95)">batch: 32 per row</text>'
    )
    body.append('<text x="430" y="175" text-anchor="middle">hidden: 32 per column</text>')
    return _svg(620, 190, body)


def lazy_sum_figure() -> str:
    """einsum over a split contracted dim: partial sums, settled once, when needed."""
    title = "h = einsum(x[batch, io:cols], w[io:cols, hidden]) sums io, which is split"
    body = [f'<text x="10" y="20" font-weight="bold">{title}</text>']
    for c in range(4):
        x = 20 + c * 110
        body.append(f'<rect x="{x}" y="35" width="90" height="40" fill="{COLORS[c]}"/>')
        body.append(
            f'<text x="{x + 45}" y="60" fill="white" text-anchor="middle">partial h, dev {c}</text>'
        )
        body.append(f'<line x1="{x + 45}" y1="75" x2="240" y2="115" stroke="#555"/>')
    body.append(
        '<rect x="150" y="115" width="180" height="34" fill="#ddd" stroke="#555"/>'
    )
    body.append(
        '<text x="240" y="137" text-anchor="middle">one allreduce over cols</text>'
    )
    body.append(
        '<text x="350" y="130">only when a consumer needs the sum: partial sums</text>'
    )
    body.append(
        '<text x="350" y="146">add up first, and a split right after it makes it</text>'
    )
    body.append('<text x="350" y="162">a reduce-scatter</text>')
    return _svg(720, 175, body)


if __name__ == "__main__":
    (HERE / "layout.svg").write_text(layout_figure())
    (HERE / "lazy-sum.svg").write_text(lazy_sum_figure())
