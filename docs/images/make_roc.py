"""Regenerates docs/images/roc.png from a run of the main job.

The front page shows the ROC of a real run, not of toy data: `make demo`
(or `python examples/train_dp_fedemb.py --reference`) writes
`runs/<date-time>/roc.png`, and this copies the newest one here:

    make demo && python docs/images/make_roc.py
"""

import pathlib
import shutil

root = pathlib.Path(__file__).resolve().parents[2]
runs = sorted((root / "runs").glob("*/roc.png"))
if not runs:
    raise SystemExit("No runs/*/roc.png: run `make demo` first.")
shutil.copyfile(runs[-1], pathlib.Path(__file__).with_name("roc.png"))
print(f"docs/images/roc.png <- {runs[-1].relative_to(root)}")
