"""The most expensive tests of a run, by CPU-seconds: what `.ci/run` prints at its end, so the test
that would push a slow box past CI's 90 minutes is seen in the run that adds it.

    python3 tools/test_costs.py [FOLDER] [--top N]

FOLDER holds the JSON lines the root conftest writes when $RAYTRAIN_TEST_COSTS names it (one file
per pytest process; raytrain_testkit.costs says what a test's CPU-seconds count). Standard library
only: `.ci/run` calls it with the system's python3.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_costs(folder: Path) -> list[dict[str, object]]:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def table(rows: list[dict[str, object]], top: int) -> str:
    ranked = sorted(rows, key=lambda row: float(str(row["cpu_s"])), reverse=True)
    total = sum(float(str(row["cpu_s"])) for row in rows)
    kinds = sorted({str(row.get("counted_by", "process tree (a floor)")) for row in rows})
    lines = [
        f"the {min(top, len(rows))} most expensive of {len(rows)} tests ({total:,.0f} CPU-s in all, "
        f"counted by {' and '.join(kinds)}):"
    ]
    lines.append(f"{'CPU-s':>8} {'wall s':>8}  test")
    for row in ranked[:top]:
        lines.append(
            f"{float(str(row['cpu_s'])):8.1f} {float(str(row['wall_s'])):8.1f}  {row['test']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=".nox/test-costs", type=Path)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    rows = read_costs(args.folder)
    print(table(rows, args.top) if rows else f"no test costs in {args.folder}")


if __name__ == "__main__":
    main()
