"""Writes the two workflow diagrams of the front page (SVG, no dependencies).

python docs/images/make_diagrams.py
"""

import pathlib

BOX, GAP, MARGIN, TOP, HEIGHT = 160, 32, 10, 40, 120
COLOURS = ("#eef4fb", "#eaf6ec", "#fdf3e6", "#fbeaea", "#eaf6ec")


def diagram(title, boxes, loop_note=None):
    """An SVG of `boxes` ([(heading, [lines])]) joined left to right."""
    width = 2 * MARGIN + len(boxes) * BOX + (len(boxes) - 1) * GAP
    height = TOP + HEIGHT + (50 if loop_note else 20)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f"  <title>{title}</title>",
        '  <defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="#444"/></marker></defs>',
        f'  <rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    middle = TOP + HEIGHT / 2
    for i, (heading, lines) in enumerate(boxes):
        x = MARGIN + i * (BOX + GAP)
        colour = COLOURS[i % len(COLOURS)]
        out.append(
            f'  <rect x="{x}" y="{TOP}" width="{BOX}" height="{HEIGHT}" rx="8" '
            f'fill="{colour}" stroke="#444" stroke-width="1.5"/>'
        )
        centre = x + BOX / 2
        out.append(
            f'  <text x="{centre}" y="{TOP - 12}" text-anchor="middle" '
            f'font-weight="bold" fill="#222">{heading}</text>'
        )
        first = middle - 9 * (len(lines) - 1)
        for j, line in enumerate(lines):
            out.append(
                f'  <text x="{centre}" y="{first + 18 * j + 4}" '
                f'text-anchor="middle" fill="#222">{line}</text>'
            )
        if i:
            out.append(
                f'  <line x1="{x - GAP}" y1="{middle}" x2="{x - 2}" y2="{middle}" '
                'stroke="#444" stroke-width="1.5" marker-end="url(#arrow)"/>'
            )
    if loop_note:
        last = MARGIN + (len(boxes) - 1) * (BOX + GAP) + BOX / 2
        first = MARGIN + BOX / 2
        bottom = TOP + HEIGHT
        out.append(
            f'  <path d="M {last} {bottom} C {last} {bottom + 40}, {first} '
            f'{bottom + 40}, {first} {bottom + 2}" fill="none" stroke="#444" '
            'stroke-width="1.5" stroke-dasharray="5 4" marker-end="url(#arrow)"/>'
        )
        out.append(
            f'  <text x="{width / 2}" y="{bottom + 44}" text-anchor="middle" '
            f'fill="#555">{loop_note}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


FEDEMB_ROUND = diagram(
    "One DP-FedEmb round",
    [
        (
            "private users",
            ["each user's images", "and identities:", "the privacy unit"],
        ),
        (
            "virtual clients",
            ["k users per client;", "each round samples", "clients (Poisson, q)"],
        ),
        (
            "local training",
            [
                "backbone + a fresh",
                "local head, a few",
                "local steps; the",
                "head is thrown away",
            ],
        ),
        (
            "clip and noise",
            [
                "each client's update",
                "clipped to norm C;",
                "sum + N(0, (zC)²),",
                "drawn once a round",
            ],
        ),
        (
            "server step",
            [
                "the noisy mean",
                "updates the backbone",
                "(any Keras optimizer);",
                "ε counts the round",
            ],
        ),
    ],
    loop_note="next round, with the updated backbone",
)

LAST_LAYER = diagram(
    "Last-layer DP on a frozen public backbone",
    [
        (
            "private images",
            ["labelled examples;", "the privacy unit", "is one example"],
        ),
        (
            "frozen backbone",
            ["pretrained on public", "data, never updated", "(features.extract)"],
        ),
        ("clip features", ["each feature vector", "to norm C_x"]),
        ("DP head", ["DP-SGD, DP-LS,", "DP-Newton or DP-FC:", "noisy statistics only"]),
        ("classifier", ["backbone + head:", "one Keras model,", "with its ε"]),
    ],
)

if __name__ == "__main__":
    here = pathlib.Path(__file__).parent
    (here / "fedemb_round.svg").write_text(FEDEMB_ROUND)
    (here / "last_layer_pipeline.svg").write_text(LAST_LAYER)
