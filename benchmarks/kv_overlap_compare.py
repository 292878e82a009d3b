"""The KV overlap's effect on the `make paper` quick sweep: SLO attainment per policy and rate, on
against off, from two sweep outputs made on the same scanned rates.

    python -m benchmarks.paper --quick --parts slo,scan,sweep --out ON
    cp ON/scan.json OFF/ && python -m benchmarks.paper --quick --parts slo,sweep --reuse --no-kv-overlap --out OFF
    python -m benchmarks.kv_overlap_compare ON OFF [--json benchmarks/results/kv_overlap_quick.json]
"""
from __future__ import annotations

import argparse
import json
import os
from benchmarks import write_json


def _points(d: str) -> dict:
    with open(os.path.join(d, "sweep.json")) as f:
        pts = json.load(f)["points"]
    return {(p["preset"], p["policy"], p["prefill"], p["decode"], p["rate"]): p for p in pts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("on")
    ap.add_argument("off")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    on, off = _points(a.on), _points(a.off)
    rows = []
    for k in sorted(on):
        if k not in off:
            continue
        x, y = on[k], off[k]
        rows.append({"preset": k[0], "policy": k[1], "prefill": k[2], "decode": k[3], "rate": k[4],
                     "slo_attainment_on": x["slo_attainment"], "slo_attainment_off": y["slo_attainment"],
                     "delta": x["slo_attainment"] - y["slo_attainment"],
                     "ttft_p90_incremental_on_s": x["ttft_incremental_s"]["p90"],
                     "ttft_p90_incremental_off_s": y["ttft_incremental_s"]["p90"],
                     "local_fraction_on": x["local_fraction"], "local_fraction_off": y["local_fraction"]})
    changed = [r for r in rows if r["delta"] != 0.0]
    by_policy: dict = {}
    for r in rows:
        b = by_policy.setdefault(r["policy"], {"points": 0, "changed": 0, "mean_delta": 0.0})
        b["points"] += 1
        b["changed"] += r["delta"] != 0.0
        b["mean_delta"] += r["delta"]
    for b in by_policy.values():
        b["mean_delta"] /= b["points"]
    out = {"command": "python -m benchmarks.kv_overlap_compare " + " ".join(argv or []),
           "method": "make paper quick sweep (Llama-3.1-70B@H20, 4 presets, 3 rates each, 1 seed) run twice on the "
                     "same scanned rates: kv_overlap on (default) and off (--no-kv-overlap)",
           "by_policy": by_policy, "points": rows}
    for r in rows:
        print(f"{r['preset']:9s} {r['policy']:15s} {r['prefill']:>6s}/{r['decode']:<7s} rate {r['rate']:<7g} "
              f"on {r['slo_attainment_on']:.3f} off {r['slo_attainment_off']:.3f} delta {r['delta']:+.3f}")
    print(f"{len(changed)}/{len(rows)} points changed; by policy: {json.dumps(by_policy)}")
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
