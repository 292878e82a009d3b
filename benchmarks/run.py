"""`make bench`: every benchmark, each writing its JSON to benchmarks/results/."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = ["benchmarks.live_overhead", "benchmarks.sched", "benchmarks.sim_speed", "benchmarks.tracing_overhead",
              "benchmarks.kv_tier", "benchmarks.prefix_sharing"]


def main(argv: list[str]) -> int:
    names = [f"benchmarks.{a}" for a in argv] or BENCHMARKS
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                print(f"skipping {name}: not present", file=sys.stderr)
                continue
            raise
        print(f"== {name}", file=sys.stderr)
        sys.argv = [name]  # each benchmark parses its own flags: run it with its defaults, not run's names
        mod.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
