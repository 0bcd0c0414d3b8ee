"""How many tests the pytest sessions in the given logs ran: their summary lines added up.

    python3 .ci/tests_run.py LOG...   # "612 tests run (604 passed), 32 skipped"
"""

import re
import sys
from collections import Counter

# pytest's last line, with or without -q: "604 passed, 32 skipped, 179 warnings in 298.05s (0:04:58)"
SUMMARY = re.compile(r"^[=\s]*((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s\b")
RAN = ("passed", "failed", "xfailed", "xpassed")


def main(logs: list[str]) -> str:
    counts: Counter[str] = Counter()
    for log in logs:
        with open(log, errors="replace") as f:
            for line in f:
                match = SUMMARY.match(line)
                if match:
                    for number, outcome in re.findall(r"(\d+) ([a-z]+)", match.group(1)):
                        counts[outcome.rstrip("s") if outcome == "errors" else outcome] += int(number)
    ran = sum(counts[o] for o in RAN)
    failed = f", {counts['failed']} failed" if counts["failed"] else ""
    errors = f", {counts['error']} errors" if counts["error"] else ""
    return f"{ran} tests run ({counts['passed']} passed{failed}{errors}), {counts['skipped']} skipped"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
