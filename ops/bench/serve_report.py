"""`pagoda bench serve`'s report: every pass's figures -> per workload and system the first
pass, the warm passes' medians and the CPU seconds by process, and pagoda over vLLM with each
round's ratio (serve_compare.py runs the passes)."""
import statistics

# The TTFT mean beside its median: when a burst of prompts arrives at once, each gets its first
# token at the end of one of a few prefill steps, and which step the median request falls in
# can move the p50 by a whole step; the mean moves with every request.
FIGURES = ("output_tok_s", "ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms")


def figures(summary: dict) -> dict:
    return {"output_tok_s": summary["output_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_mean_ms": summary["ttft_ms"]["mean"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"]}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def median_figures(passes: list[dict]) -> dict:
    return {k: _median([p["figures"].get(k) for p in passes]) for k in FIGURES}


def median_cpu(passes: list[dict]) -> dict:
    """Median CPU seconds per pass by role (a role missing from a pass counts 0 there)."""
    roles = sorted({r for p in passes for r in p["cpu_s"]})
    out = {r: _median([p["cpu_s"].get(r, 0.0) for p in passes]) for r in roles}
    out["client"] = _median([p["client_cpu_s"] for p in passes])
    return out


def workload_report(passes: list[dict]) -> dict:
    """One system's passes of one workload (every round) -> the first pass's figures (median
    over rounds), the warm passes' medians, first / warm, and the CPU table."""
    first = [p for p in passes if p["kind"] == "first"]
    warm = [p for p in passes if p["kind"] == "warm"]
    out = {"first": median_figures(first), "warm": median_figures(warm) if warm else None,
           "cpu_s_per_pass": {"first": median_cpu(first)},
           # Requests that failed, over every pass: the figures leave them out.
           "failed": sum(p["summary"].get("failed") or 0 for p in passes)}
    if warm:
        out["first_over_warm"] = {k: _ratio(out["first"][k], out["warm"][k]) for k in FIGURES}
        out["cpu_s_per_pass"]["warm"] = median_cpu(warm)
    worker = [p["worker"] for p in passes if p.get("worker")]
    if worker:
        out["worker_per_pass"] = {k: _median([w[k] for w in worker]) for k in worker[0]}
    return out


def settled(report: dict) -> dict:
    """The figures a comparison uses: the warm passes' medians, else the first pass's."""
    return report["warm"] or report["first"]


def compare(passes_a: list[dict], passes_b: list[dict]) -> dict:
    """System a over system b on one workload: the ratio of the settled medians, and each
    round's ratio (each round's own settled median output tok/s)."""
    ra, rb = workload_report(passes_a), workload_report(passes_b)
    out = {k: _ratio(settled(ra)[k], settled(rb)[k]) for k in FIGURES}
    rounds = sorted({p["round"] for p in passes_a} & {p["round"] for p in passes_b})
    by_round = []
    for r in rounds:
        a = settled(workload_report([p for p in passes_a if p["round"] == r]))
        b = settled(workload_report([p for p in passes_b if p["round"] == r]))
        by_round.append(_ratio(a["output_tok_s"], b["output_tok_s"]))
    out["output_tok_s_by_round"] = by_round
    out["output_tok_s_median_of_rounds"] = _median(by_round)
    return out


def build_report(passes: list[dict], systems: list[str]) -> dict:
    """Every pass (system, workload, round, kind, figures, CPU) -> per workload and system the
    report, and pagoda over vLLM where both ran."""
    workloads = list(dict.fromkeys(p["workload"] for p in passes))
    out = {}
    for w in workloads:
        entry = {}
        for s in systems:
            mine = [p for p in passes if p["workload"] == w and p["system"] == s]
            if mine:
                entry[s] = workload_report(mine)
        if "pagoda" in entry and "vllm" in entry:
            entry["pagoda_over_vllm"] = compare(
                [p for p in passes if p["workload"] == w and p["system"] == "pagoda"],
                [p for p in passes if p["workload"] == w and p["system"] == "vllm"])
        out[w] = entry
    return out


def cpu_line(cpu: dict) -> str:
    return ", ".join(f"{role} {s:.2f}" for role, s in cpu.items() if s is not None)


def worker_line(w: dict) -> str:
    parts = [f"busy {w.get('busy_s', 0):.2f} s", f"idle {w.get('idle_s', 0):.2f} s",
             f"{w.get('steps', 0)} steps"]
    if "busy_ms_per_step" in w:
        parts.append(f"{w['busy_ms_per_step']:.1f} ms busy + {w['idle_ms_per_step']:.2f} ms "
                     "idle per step")
    return ", ".join(parts)


def _fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def print_report(report: dict, systems: list[str]) -> None:
    for w, entry in report.items():
        print(f"=== workload {w}")
        print(f"  {'system':8} {'pass':6} {'out tok/s':>10} {'TTFT p50':>10} {'TTFT mean':>10} "
              f"{'TPOT p50':>10}")
        for s in systems:
            if s not in entry:
                continue
            rows = [("first", entry[s]["first"]), ("warm", entry[s]["warm"]),
                    ("first/w", entry[s].get("first_over_warm"))]
            for label, f in rows:
                if f:
                    d = 2 if label == "first/w" else 1
                    print(f"  {s:8} {label:6} {_fmt(f['output_tok_s'], d):>10} "
                          f"{_fmt(f['ttft_p50_ms'], d):>10} {_fmt(f['ttft_mean_ms'], d):>10} "
                          f"{_fmt(f['tpot_p50_ms'], d):>10}")
            if entry[s].get("failed"):
                print(f"  {s:8} FAILED REQUESTS: {entry[s]['failed']} over its passes (the "
                      f"figures above leave them out)")
        if "pagoda_over_vllm" in entry:
            c = entry["pagoda_over_vllm"]
            by_round = ", ".join(_fmt(x, 2) for x in c["output_tok_s_by_round"])
            print(f"  pagoda / vLLM: output tok/s {_fmt(c['output_tok_s'], 2)}x (rounds: "
                  f"{by_round}), TTFT p50 {_fmt(c['ttft_p50_ms'], 2)}x, TTFT mean "
                  f"{_fmt(c['ttft_mean_ms'], 2)}x, TPOT p50 {_fmt(c['tpot_p50_ms'], 2)}x")
        print("  CPU seconds per pass (median), by process:")
        for s in systems:
            for kind, cpu in entry.get(s, {}).get("cpu_s_per_pass", {}).items():
                print(f"    {s} {kind}: {cpu_line(cpu)}")
            worker = entry.get(s, {}).get("worker_per_pass")
            if worker:
                print(f"    {s} worker per pass: {worker_line(worker)}")
