"""Sum the JUnit XML reports the nox sessions wrote into one closing line."""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
reports = sorted(Path(sys.argv[1]).glob("*.xml")) if Path(sys.argv[1]).is_dir() else []
for report in reports:
    root = ET.parse(report).getroot()
    for suite in root.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"{len(reports)} sessions reported")
print(f"{passed} passed, {failed} failed, {totals['skipped']} skipped")
sys.exit(1 if failed or not reports else 0)
