"""The GPU check's command line: the arguments, the sections in order (each started only with
enough time left before --deadline-s), the watchdog that prints the table at the deadline, and
the end of a run (the table printed and written, children stopped)."""
import argparse
import contextlib
import os
import shutil
import tempfile
import threading
import time

from .env import section_env
from .graphs import section_graphs
from .kernel_checks import section_kernels
from .measure import free_device_memory
from .parity import section_parity
from .plan import cpu_plan, cuda_plan, serve_model
from .report import Row, Run, log, table_lines, write_results
from .serve import section_serve, stop_process
from .throughput import section_throughput

# The first line of the package's docstring, --help's description.
DESCRIPTION = ('The GPU check: one run on a GPU machine that measures what docs/benchmarks.md\'s '
               '"GPU check')


def sections(run: Run) -> list:
    """(name, skipped because, function) in the order they run."""
    a, p = run.args, run.plan
    items = [("env", None, section_env),
             ("kernels", "--skip-kernels" if a.skip_kernels else None, section_kernels),
             ("parity", "--skip-parity" if a.skip_parity else None, section_parity)]
    for spec in p.models:
        why = ("--skip-throughput" if a.skip_throughput else
               "not in --models" if a.models and spec.name.lower() not in a.models else None)
        items.append((f"throughput {spec.name}", why,
                      lambda run, device, spec=spec: section_throughput(run, device, spec)))
        if spec.name == serve_model(p).name:  # on the model that throughput section saves
            items.append(("graphs", "--skip-graphs" if a.skip_graphs else None,
                          section_graphs))
    serve_why = ("--skip-serve" if a.skip_serve else
                 "--device cpu (smoke mode)" if not p.serve else None)
    items.append(("serve", serve_why, section_serve))
    return items


def run_section(run: Run, name: str, fn, device) -> None:
    left = run.args.deadline_s - (time.monotonic() - run.started)
    needed = run.plan.min_left_s.get(name, 0)
    if left < needed:
        reason = f"{left:.0f} s left before the deadline, {needed} s needed"
        log(run, f"{name}: skipped: {reason}")
        run.rows.append(Row(name.split()[0], name, f"skipped: {reason}", verdict="skipped"))
        return
    log(run, f"== {name}")
    run.section = name
    try:
        rows = fn(run, device)
    except Exception as e:  # the table reports it; the next section still runs
        log(run, f"{name} FAILED: {type(e).__name__}: {e}")
        rows = [Row(name.split()[0], name, f"FAILED: {type(e).__name__}: {e}",
                    verdict="FAILED")]
    finally:
        run.section = None
        free_device_memory(device)
    with run.lock:
        run.rows.extend(rows)
        write_results(run)


def finish(run: Run, note: str | None = None) -> int:
    """The table, printed and written; children stopped; the work folder removed. -> exit
    status: 1 when a row failed or mismatched."""
    with run.lock:
        if run.finished:
            return 0
        if note:
            name = run.section or "run"
            run.rows.append(Row(name.split()[0], name, f"FAILED: {note}", verdict="FAILED"))
            run.rows += [Row(later.split()[0], later, "skipped: the deadline came first",
                             verdict="skipped") for later in run.pending]
        run.finished = True
        for proc in list(run.children):
            with contextlib.suppress(Exception):
                stop_process(run, proc, grace_s=5.0)
        write_results(run)
        print("\n" + "\n".join(table_lines(run.rows)), flush=True)
        print(f"\n(written to {run.results_dir}/gpu_check.json and gpu_check.md; "
              f"{time.monotonic() - run.started:.0f} s)", flush=True)
        shutil.rmtree(run.work_dir, ignore_errors=True)
    return 1 if any(r.verdict in ("FAILED", "MISMATCH") for r in run.rows) else 0


def start_watchdog(run: Run) -> None:
    """At the deadline: the table as it stands, then exit, whatever the main thread does."""
    def expire():
        log(run, f"deadline of {run.args.deadline_s:.0f} s reached")
        finish(run, f"deadline of {run.args.deadline_s:.0f} s reached during this section")
        os._exit(2)
    timer = threading.Timer(max(0.0, run.args.deadline_s - (time.monotonic() - run.started)),
                            expire)
    timer.daemon = True
    timer.start()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.gpu_check",
                                     description=DESCRIPTION)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when there is one; cpu is the smoke mode")
    parser.add_argument("--quick", action="store_true",
                        help="fewer kernel shapes, parity cases and smaller workloads")
    for name in ("kernels", "parity", "throughput", "graphs", "serve"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--models", nargs="+", type=str.lower, default=None,
                        help="throughput models to run (1b, 8b; default all)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--hf-prompts", type=int, default=None,
                        help="prompts transformers runs (its rate does not depend on it)")
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--deadline-s", type=float, default=450.0,
                        help="print the table and exit after this long (default %(default)s)")
    parser.add_argument("--results-dir", default=None,
                        help="default: $OUT if set, else ops/results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        # triton.jit reads this when the kernel modules are imported, later on.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    plan = cuda_plan(args.quick) if args.device == "cuda" else cpu_plan()
    results_dir = args.results_dir or os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "results")
    run = Run(plan=plan, args=args, results_dir=results_dir,
              work_dir=tempfile.mkdtemp(prefix="gpu_check-"))
    start_watchdog(run)
    log(run, f"GPU check on {args.device}{' (quick)' if args.quick else ''}; deadline "
             f"{args.deadline_s:.0f} s; results to {results_dir}")
    device = torch.device(args.device)
    planned = sections(run)
    run.pending = [name for name, skipped_because, _ in planned if not skipped_because]
    for name, skipped_because, fn in planned:
        if name in run.pending:
            run.pending.remove(name)
        if skipped_because:
            log(run, f"{name}: skipped: {skipped_because}")
            run.rows.append(Row(name.split()[0], name, f"skipped: {skipped_because}",
                                verdict="skipped"))
            continue
        run_section(run, name, fn, device)
    return finish(run)
