"""Markdown tables from benchmarks/results/paper/*.json (used to write docs/paper-results.md).

    python -m benchmarks.paper_tables [--out benchmarks/results/paper] > /tmp/tables.md
"""
from __future__ import annotations

import argparse
import json
import math
import os

SHORT = {"llama3.1-70b@h20": "Llama3.1-70B", "qwen3-32b@h20": "Qwen3-32B", "mixtral-8x7b@h20": "Mixtral-8x7B"}


def pct(x, nd=0):
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x * 100:.{nd}f}"


def g(x):
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:+.1f}%"


def load(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/paper")
    a = ap.parse_args()
    d = a.out
    slo = load(d, "slo.json")
    if slo:
        print("### SLO thresholds\n")
        print(f"Rule: {slo['rule']}\n")
        print("| model | preset | P / D (Table 2 #1) | P90 standalone prefill (s) | median initial prefill (s) "
              "| TTFT_thres (s) | ITL_thres (ms) | sessions feasible on an idle cluster |")
        print("|---|---|---|---|---|---|---|---|")
        for k, v in slo["slos"].items():
            print(f"| {SHORT[v['model']]} | {v['preset']} | {v['prefill']} / {v['decode']} | "
                  f"{v['p90_standalone_prefill_s']:.2f} | {v['median_initial_prefill_s']:.2f} | {v['ttft_s']:.2f} | "
                  f"{v['itl_s'] * 1000:.1f} | {v['idle_feasible_sessions'] * 100:.1f}% |")
        print()
    pl = load(d, "plan.json")
    if pl:
        print("### Our planner beside Table 2\n")
        print("Planner on the seed-0 trace at `plan_rate` (between the sweep's middle and highest rates); attainment = AMPD simulated on that whole "
              "trace (a co-located deployment under `colocated`). Table 2's own top 3 simulated the same way.\n")
        print("| model | preset (GPUs) | rate | Table 2 top 3 (att. %) | ours, Table 2's form: top 3 (att. %) | "
              "ours, whole space: top 3 (att. %) | best for remote | best co-located (colocated / continuum) |")
        print("|---|---|---|---|---|---|---|---|")
        for k, c in pl["cases"].items():
            m, p_ = k.split("|")
            t2 = ", ".join(f"P {e['prefill']} D {e['decode']} ({pct(e['slo_attainment'], 1)})" for e in c["table2"])

            def top(name, c=c):
                return ", ".join(f"P {e['prefill']} D {e['decode']} ({pct(e['slo_attainment'], 1)})"
                                 for e in c["plans"][name]["top"])

            def first(name, c=c):
                e = c["plans"][name]["top"][0]
                return f"P {e['prefill']} D {e['decode']} ({pct(e['slo_attainment'], 1)})"
            print(f"| {SHORT[m]} | {p_} ({c['gpus']}) | {c['rate']} | {t2} | {top('table2-form')} | {top('ampd')} | "
                  f"{first('remote')} | {first('colocated')} / {first('continuum')} |")
        print()
    sw = load(d, "sweep.json")
    if sw:
        print("### Deployments of the sweep's lines\n")
        labels = ["ampd", "ampd-table2", "remote", "remote-best", "colocated", "continuum"]
        print("| model | preset | " + " | ".join(labels) + " |")
        print("|---|---|" + "---|" * len(labels))
        keys = sorted({k.rsplit("|", 1)[0] for k in sw["deployments"]})
        for k in keys:
            m, p_ = k.split("|")
            cells = []
            for lab in labels:
                v = sw["deployments"][f"{k}|{lab}"]
                pol = "" if v["policy"] == lab.split("-")[0] else f" ({v['policy']})"
                cells.append(f"P {v['prefill']} D {v['decode']}{pol}")
            print(f"| {SHORT[m]} | {p_} | " + " | ".join(cells) + " |")
        print()
        print("### SLO attainment (%) per rate (means over seeds)\n")
        cols = ["ampd", "ampd-noreorder", "ampd-window", "ampd-margin", "ampd-table2", "remote", "remote-best",
                "colocated", "continuum"]
        print("| model | preset | rate (sess/s) | " + " | ".join(cols) + " | AMPD >= every baseline? |")
        print("|---|---|---|" + "---|" * len(cols) + "---|")
        for e in sw["table"]:
            best = max(e[x] for x in ("remote", "remote-best", "colocated", "continuum"))
            mark = "yes" if e["ampd"] >= best - 1e-9 else f"**no** (-{(best - e['ampd']) * 100:.1f} pts)"
            print(f"| {SHORT[e['model']]} | {e['preset']} | {e['rate']} | " +
                  " | ".join((f"**{pct(e[c], 1)}**" if c == "ampd" else pct(e[c], 1)) for c in cols) + f" | {mark} |")
        print()
        print("### Headline: each line's mean attainment, and `ampd` against it\n")
        print("| line | mean attainment (%) | `ampd` vs it: mean relative gain (median; mean where it is >= 10 %) "
              "| absolute gain (pts); points worse |")
        print("|---|---|---|---|")
        n = len(sw["table"])
        for c in cols:
            mean = sum(e[c] for e in sw["table"]) / n
            if c == "ampd":
                print(f"| **ampd** | **{mean * 100:.1f}** | — | — |")
                continue
            rel = [(e["ampd"] - e[c]) / e[c] * 100 for e in sw["table"] if e[c] > 0]
            rel10 = [(e["ampd"] - e[c]) / e[c] * 100 for e in sw["table"] if e[c] >= 0.1]
            med = sorted(rel)[len(rel) // 2] if rel else float("nan")
            diffs = [(e["ampd"] - e[c]) * 100 for e in sw["table"]]
            worse = [x for x in diffs if x < -1e-6]
            wtxt = f"{len(worse)} / {n}" + (f" (by <= {-min(worse):.1f} pts)" if worse else "")
            print(f"| {c} | {mean * 100:.1f} | {sum(rel) / max(len(rel), 1):+.1f} % ({med:+.1f} %; "
                  f"{sum(rel10) / max(len(rel10), 1):+.1f} %, {len(rel10)} points) | "
                  f"{sum(diffs) / n:+.1f}; {wtxt} |")
        print()
        print("### Attainment (%) at the rates of each panel, in order\n")
        print("| model | preset | rates (sessions/s) | " + " | ".join(cols) + " |")
        print("|---|---|---|" + "---|" * len(cols))
        panels = {}
        for e in sw["table"]:
            panels.setdefault((e["model"], e["preset"]), []).append(e)
        for (m, p_), es in panels.items():
            es = sorted(es, key=lambda e: e["rate"])

            def f1(x):
                return "100" if x >= 0.9995 else f"{x * 100:.1f}"
            print(f"| {SHORT[m]} | {p_} | {', '.join(str(e['rate']) for e in es)} | " +
                  " | ".join(", ".join(f1(e[c]) for e in es) for c in cols) + " |")
        print()
        print("### Average gains of AMPD\n")
        print("| baseline | mean relative gain | median | max | min | points (finite / baseline 0, AMPD > 0 / both 0) "
              "| mean absolute gain (pts) | points where AMPD is worse |")
        print("|---|---|---|---|---|---|---|---|")
        for b, v in sw["gains"].items():
            print(f"| {b} | {g(v['mean_rel_pct'])} | {g(v['median_rel_pct'])} | {g(v['max_rel_pct'])} | "
                  f"{g(v['min_rel_pct'])} | {v['points_finite']} / {v['points_baseline_zero_ampd_positive']} / "
                  f"{v['points_both_zero']} | {v['mean_abs_pts']:+.1f} | {v['ampd_worse_points']} |")
        print()
        print("### Per model x preset: AMPD's relative gain (mean / worst / best over the rates)\n")
        print("| model | preset | vs remote | vs remote-best | vs colocated | vs continuum |")
        print("|---|---|---|---|---|---|")
        per = {b: sw["gains"][b]["per_model_preset"] for b in ("remote", "remote-best", "colocated", "continuum")}
        for k in per["remote"]:
            m, p = k.split("|")
            cells = []
            for b in ("remote", "remote-best", "colocated", "continuum"):
                v = per[b][k]
                inf = f" (+{v['inf_points']} pts vs 0)" if v["inf_points"] else ""
                cells.append(f"{g(v['mean_rel_pct'])} / {g(v['min_rel_pct'])} / {g(v['max_rel_pct'])}{inf}")
            print(f"| {SHORT[m]} | {p} | " + " | ".join(cells) + " |")
        print()
    br = load(d, "breakdown.json")
    if br:
        print("### Breakdown at the middle rate\n")
        print("| model | preset | rate | policy | deployment | SLO att. | TTFT ok | ITL ok | TTFT init mean (s) | "
              "TTFT incr mean (s) | ITL mean (ms) | ITL p99 (ms) | local |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for o in br["rows"]:
            print(f"| {SHORT[o['model']]} | {o['preset']} | {o['rate']} | {o['policy']} | {o['deployment']} | "
                  f"{pct(o['slo_attainment'])} | {pct(o['ttft_attainment'])} | {pct(o['itl_attainment'])} | "
                  f"{o['ttft_initial_mean_s']:.2f} | {o['ttft_incremental_mean_s']:.2f} | {o['itl_mean_s'] * 1000:.1f} | "
                  f"{o['itl_p99_s'] * 1000:.0f} | {pct(o['local_fraction'])} |")
        print()
    ab = load(d, "ablation.json")
    if ab:
        print("### Ablation at the middle rate and at the 4th (second-highest) rate\n")
        print("| model | preset | rate | remote | + routing (ampd-noreorder) | + reordering (ampd) | routing gain | "
              "reorder extra | both | AMPD local share |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        rates = {}
        for o in ab["rows"]:
            rates.setdefault((o["model"], o["preset"]), []).append(o["rate"])
        for o in ab["rows"]:
            rs = sorted(rates[(o["model"], o["preset"])])
            if not (o["middle"] or (len(rs) >= 4 and o["rate"] == rs[3])):
                continue
            print(f"| {SHORT[o['model']]} | {o['preset']} | {o['rate']} | {pct(o['att_remote'], 1)} | "
                  f"{pct(o['att_ampd-noreorder'], 1)} | {pct(o['att_ampd'], 1)} | {g(o['routing_gain_pct'])} | "
                  f"{g(o['reorder_extra_pct'])} | {g(o['both_pct'])} | {pct(o['ampd_local_fraction'], 1)} |")
        print()
    ls = load(d, "local_share.json")
    if ls:
        print("### AMPD local share by rate\n")
        print("| model | preset | local share per rate (rate: %) |")
        print("|---|---|---|")
        for k, v in ls["ampd_local_fraction_by_rate"].items():
            m, p = k.split("|")
            print(f"| {SHORT[m]} | {p} | " + ", ".join(f"{r}: {x * 100:.1f}" for r, x in v.items()) + " |")
        print()
    se = load(d, "sensitivity.json")
    if se:
        print(f"### Sensitivity ({se['model']}, {se['preset']}, seeds {se['seeds']})\n")
        for slack in ("queue", "window"):
            for param in ("w", "alpha", "beta"):
                rows = [o for o in se["rows"] if o["slack"] == slack and o["param"] == param]
                vals = sorted({o["value"] for o in rows})
                print(f"slack={slack}, {param}:\n")
                print("| rate | " + " | ".join(str(v) for v in vals) + " | band (pts) |")
                print("|---|" + "---|" * (len(vals) + 1))
                for rate in se["rates"]:
                    xs = [[o for o in rows if o["rate"] == rate and o["value"] == v][0]["slo_attainment"] for v in vals]
                    print(f"| {rate} | " + " | ".join(pct(x, 1) for x in xs) +
                          f" | {(max(xs) - min(xs)) * 100:.1f} |")
                print()
    ir = load(d, "itl_rule.json")
    if ir:
        print("### Attainment by the ITL statistic the SLO judges (middle rate)\n")
        print("| model | preset | rate | policy | mean ITL (our rule) | P90 gap | P99 gap | max gap |")
        print("|---|---|---|---|---|---|---|---|")
        for o in ir["rows"]:
            print(f"| {SHORT[o['model']]} | {o['preset']} | {o['rate']} | {o['policy']} | {pct(o['att_itl_mean'], 1)} | "
                  f"{pct(o['att_itl_p90'], 1)} | {pct(o['att_itl_p99'], 1)} | {pct(o['att_itl_max'], 1)} |")
        print()
    ch = load(d, "chunked.json")
    if ch and "rows" in ch:
        print("### Beyond the paper: chunked local prefill\n")
        print(f"Summary: {json.dumps(ch['summary'])}\n")
        print("| model | preset | rate | ampd | ampd+chunked | colocated | colocated+chunked |")
        print("|---|---|---|---|---|---|---|")
        by = {}
        for r in ch["rows"]:
            by.setdefault((r["model"], r["preset"], r["rate"]), {})[r["policy"]] = r
        for (m, p, rate), v in by.items():
            u = next(iter(v.values()))["unchunked"]
            print(f"| {SHORT[m]} | {p} | {rate} | {pct(u['ampd'], 1)} | {pct(v['ampd+chunked']['slo_attainment'], 1)} | "
                  f"{pct(u['colocated'], 1)} | {pct(v['colocated+chunked']['slo_attainment'], 1)} |")
        print()
    kv = load(d, "kv_ratio.json")
    if kv:
        print("### T_kv / T_pre of incremental prefills\n")
        print(f"Formula: {kv['formula']}; by tokens = {kv['by_tokens']}.\n")
        b = kv["buckets"]
        print("| model | preset | set | n | by | " + " | ".join(b) + " | median ratio |")
        print("|---|---|---|---|---|" + "---|" * len(b) + "---|")
        for k, v in kv["results"].items():
            m, p = k.split("|")
            for setname in ("all_incremental", "ampd_remote_incremental"):
                s = v[setname]
                if not s["n"]:
                    continue
                for how in ("tasks", "tokens"):
                    print(f"| {SHORT[m]} | {p} | {setname} | {s['n']} | {how} | " +
                          " | ".join(pct(s[f'by_{how}'][x], 1) for x in b) + f" | {s['median_ratio'] * 100:.2f}% |")
        print()
    ti = load(d, "tightness.json")
    if ti:
        print(f"### SLO tightness ({SHORT[ti['model']]}, {ti['gpus']} GPUs, TTFT {ti['ttft_s']} s)\n")
        print(f"Traces: {ti['traces']}; arrivals over {ti['duration_s']:.0f} s; planned on seed {ti['plan_seed']}, "
              f"judged on seeds {ti['points'][0]['seeds']}.\n")
        print("| trace | ITL (ms) | ampd (deployment) | remote | colocated | continuum | ampd - best baseline (pts) "
              "| ampd-margin | best baseline's deployment |")
        print("|---|---|---|---|---|---|---|---|---|")
        for o in ti["points"]:
            a, dp = o["attainment"], o["deployments"]
            ad, bd = dp["ampd"], dp[o["best_baseline"]]
            flag = "" if o["ampd_minus_best_pts"] >= -1.0 else " **short**"
            print(f"| {o['kind']} | {o['itl_s'] * 1000:.0f} | {pct(a['ampd'], 1)} (P {ad['prefill']} D {ad['decode']}"
                  f"{'' if ad['policy'] == 'ampd' else ', ' + ad['policy']}) | {pct(a['remote'], 1)} | "
                  f"{pct(a['colocated'], 1)} | {pct(a['continuum'], 1)} | {o['ampd_minus_best_pts']:+.1f}{flag} | "
                  f"{pct(a['ampd-margin'], 1)} | {o['best_baseline']}: P {bd['prefill']} D {bd['decode']} |")
        print()
    meta = load(d, "run_meta.json")
    if meta:
        # the last run only; earlier runs (parts kept from them) are in run_meta.json "runs". There is
        # no "chunked_prefill_in_simulator" key since 4589c60: the simulator always has the option.
        print(f"Run: `{' '.join(meta['argv'])}`; timings {meta['timings_s']}, total {meta['total_s']} s; "
              f"git {meta.get('git_head') or 'unknown'}")


if __name__ == "__main__":
    main()
