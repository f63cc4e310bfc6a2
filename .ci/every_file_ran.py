"""`python .ci/every_file_ran.py REPORT TESTS`: fail, naming them, if test files in TESTS (but test_gpu.py,
whose tests all need a GPU) have no test case in pytest's JUnit XML REPORT: a file whose tests were all
deselected, skipped at import or renamed away would otherwise pass unseen."""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

report, tests = sys.argv[1], Path(sys.argv[2])
ran = {case.get("classname", "").split(".")[1] for case in ET.parse(report).iter("testcase") if case.get("classname")}
files = {path.stem for path in tests.glob("test_*.py")} - {"test_gpu"}
missing = sorted(files - ran)
for name in missing:
    print(f"FAILED: {tests / name}.py ran no test")
sys.exit(1 if missing else 0)
