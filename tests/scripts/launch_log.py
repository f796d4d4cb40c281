"""Sum a launch log (``TOOLKIT_TEST_LAUNCH_LOG=/path pytest ...``, written by helpers.log_launches) per test file and
per test: how many processes each started, their wall time and their CPU time (user + system, ranks included).

    python tests/scripts/launch_log.py /path/to/log [--tests]
"""

import json
import sys
from collections import defaultdict


def main(argv: list[str]) -> None:
    rows = [json.loads(line) for line in open(argv[0]) if line.strip()]
    per_file, per_test = defaultdict(lambda: [0, 0.0, 0.0]), defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        test = r["test"].rsplit(" (", 1)[0] or "(outside a test)"
        for key, table in ((test.split("::")[0], per_file), (test, per_test)):
            table[key][0] += 1
            table[key][1] += r["seconds"]
            table[key][2] += r.get("cpu_seconds", 0.0)
    print(f"{'file':60s} {'launches':>8s} {'seconds':>9s} {'cpu s':>9s}")
    for name, (n, s, c) in sorted(per_file.items()):
        print(f"{name:60s} {n:8d} {s:9.1f} {c:9.1f}")
    total = [sum(v[i] for v in per_file.values()) for i in range(3)]
    print(f"{'total':60s} {total[0]:8d} {total[1]:9.1f} {total[2]:9.1f}")
    if "--tests" in argv:
        print()
        for name, (n, s, c) in sorted(per_test.items()):
            print(f"{name:100s} {n:4d} {s:8.1f} {c:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
