"""`make bench` entry for `ampd bench-sched` (writes benchmarks/results/bench_sched.json)."""
from ampd.bench.sched import main

if __name__ == "__main__":
    main()
