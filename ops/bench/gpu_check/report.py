"""A GPU check run's state and its report: the table's rows, the run they belong to, the log
line, number formatting, and the table written as gpu_check.json and gpu_check.md."""
import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field

from .plan import Plan


@dataclass
class Row:
    section: str
    check: str
    result: str
    target: str = ""
    verdict: str = ""  # ok, below target, MISMATCH, FAILED, skipped; "" for a plain reading


@dataclass
class Run:
    plan: Plan
    args: argparse.Namespace
    results_dir: str
    work_dir: str  # model folders and logs, removed at the end
    started: float = field(default_factory=time.monotonic)
    rows: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)  # per section: the numbers behind its rows
    meta: dict = field(default_factory=dict)
    copy_bytes_per_s: float | None = None
    matmul_flop_per_s: float | None = None
    section: str | None = None  # the one running now
    children: list = field(default_factory=list)  # processes to stop at any exit
    folders: dict = field(default_factory=dict)  # model name -> saved folder
    pending: list = field(default_factory=list)  # sections not started yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False


def log(run: Run, message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - run.started:6.1f}s] {message}",
          flush=True)


def num(x: float) -> str:
    """Thousands separators for large numbers, three significant digits for small ones (the
    smoke mode's rates)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fraction_of_copy(run: Run, bytes_per_s: float) -> str:
    if not run.copy_bytes_per_s:
        return "n/a (no copy bandwidth)"
    return f"{bytes_per_s / run.copy_bytes_per_s:.0%} of copy"


def table_lines(rows: list) -> list:
    header = ("section", "check", "result", "target", "verdict")
    cells = [header] + [(r.section, r.check, r.result, r.target, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [
        line(c) for c in cells[1:]]


def write_results(run: Run) -> None:
    os.makedirs(run.results_dir, exist_ok=True)
    payload = dict(meta=dict(run.meta, device=run.plan.device, quick=run.args.quick,
                             elapsed_s=time.monotonic() - run.started,
                             finished=run.finished),
                   rows=[asdict(r) for r in run.rows], raw=run.raw)
    with open(os.path.join(run.results_dir, "gpu_check.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    title = (f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}: {run.meta.get('gpu', '?')}; "
             f"{run.meta.get('versions', '')}")
    with open(os.path.join(run.results_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join([title, ""] + table_lines(run.rows)) + "\n")
