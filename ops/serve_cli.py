"""`pagoda serve`: the whole stack of docker-compose.yml as local processes, until Ctrl-C."""
import argparse
import signal
import threading
import time
from dataclasses import fields

from shared.stack_config import SERVING_FIELDS, StackConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.engine_args import EngineArgs
    parser.add_argument("--compose-file", nargs="+", default=None,
                        help="the stack's description (default: the project's docker-compose.yml);"
                             " several files are merged as compose merges them (e.g. "
                             "docker-compose.yml docker-compose.dp2.yml: two engine replicas)")
    parser.add_argument("--tokenizers", type=_positive_int, default=1, help="tokenizer processes")
    parser.add_argument("--detokenizers", type=_positive_int, default=1,
                        help="detokenizer processes")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's HTTP host")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    parser.add_argument("--api-key", default=None, help="require this bearer token on HTTP")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names requests may use for the model; the first is reported")
    parser.add_argument("--no-gateway", dest="gateway", action="store_false",
                        help="no HTTP: the ZeroMQ stack only (for AsyncEngineClient)")
    parser.add_argument("--run-dir", default=None,
                        help="where the ipc sockets and logs go (default: what a bare "
                             "StackConfig() uses, so AsyncEngineClient() finds the stack)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds every service has to become ready")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of one process per minute before the launch gives up")
    parser.add_argument("--hang-timeout", type=float, default=60.0,
                        help="seconds a process may answer no health probe (stopped, hung), or "
                             "report itself stuck, before it is killed and restarted; 0: never")
    parser.add_argument("--keep-logs", action="store_true", help="keep <run-dir>/logs at exit")
    parser.add_argument("--curve-keys-dir", default=None,
                        help="encrypt and authenticate every ZeroMQ socket with the CurveZMQ "
                             "keys of this directory (`pagoda keys DIR`; default: "
                             "PAGODA_CURVE_KEYS_DIR, else off)")
    parser.add_argument("--worker-cpus", default=None,
                        help="CPUs the worker runs on, one OpenMP thread bound to each (e.g. "
                             "0-13; default: PAGODA_WORKER_CPUS, else anywhere)")
    parser.add_argument("--service-cpus", default=None,
                        help="CPUs the gateway, tokenizers, engine and detokenizers share "
                             "(default: PAGODA_SERVICE_CPUS, else anywhere)")
    parser.add_argument("--service-nice", type=int, default=None,
                        help="nice value added to those light services (default: "
                             "PAGODA_SERVICE_NICE, else 0)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="echo every process's log lines, prefixed with its name")
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser, SERVING_FIELDS,
                             title="how the stack serves chats and usage (docs/api.md; default: "
                                   "the PAGODA_* environment or .env)")


def serving_vars(args: argparse.Namespace) -> dict[str, str]:
    """The serving flags given, as the PAGODA_* variables every process reads; the launcher
    sets them last, over the compose file's values (and a .env's), for any compose file."""
    out = {}
    for name in SERVING_FIELDS:
        value = getattr(args, name)
        if value is not None:
            out["PAGODA_" + name.upper()] = str(value).lower() if isinstance(value, bool) else value
    return out


def placement_vars(args: argparse.Namespace) -> dict[str, str]:
    """The placement flags as the compose file's variables, checked here (with any of those
    variables the environment already sets) so that a bad list fails once, not in a restart
    loop of every process; each process applies its own at start (shared/placement.py)."""
    import os

    from shared.placement import PlacementError, parse_cpu_list
    out = {}
    for flag, name in (("worker_cpus", "PAGODA_WORKER_CPUS"),
                       ("service_cpus", "PAGODA_SERVICE_CPUS")):
        value = getattr(args, flag)
        if value is not None:
            out[name] = value
        value = value if value is not None else os.environ.get(name, "").strip()
        if value:
            outside = sorted(set(parse_cpu_list(value)) - os.sched_getaffinity(0))
            if outside:
                raise PlacementError(f"{name}={value}: CPUs {outside} are not available here "
                                     f"(available: {sorted(os.sched_getaffinity(0))})")
    if args.service_nice is not None:
        if args.service_nice < 0 and os.geteuid() != 0:
            raise PlacementError(f"--service-nice {args.service_nice}: only root may raise "
                                 f"a process's priority")
        out["PAGODA_SERVICE_NICE"] = str(args.service_nice)
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from shared.engine_args import EngineArgs
    from shared.logging import configure
    from ops.launcher import LaunchError, LocalStack
    from shared.curve import CurveKeysError
    from shared.placement import PlacementError
    configure("serve")
    # Only what the user set: each service keeps its own defaults for the rest.
    engine_args = {f.name: getattr(args, f.name) for f in fields(EngineArgs)
                   if getattr(args, f.name) != f.default}
    try:
        stack = LocalStack(args.compose_file, engine_args, tokenizers=args.tokenizers,
                           detokenizers=args.detokenizers, run_dir=args.run_dir, host=args.host,
                           port=args.port, gateway=args.gateway, api_key=args.api_key,
                           verbose=args.verbose, keep_logs=args.keep_logs,
                           max_restarts_per_minute=args.max_restarts,
                           curve_keys_dir=args.curve_keys_dir, hang_timeout_s=args.hang_timeout,
                           served_model_names=args.served_model_name,
                           compose_vars=placement_vars(args), env=serving_vars(args))
    except (CurveKeysError, PlacementError, ValueError) as e:  # ValueError: replica counts
        print(f"pagoda: {e}", flush=True)
        return 1
    stop = threading.Event()
    serving = False

    def on_signal(signum, frame):
        if stop.is_set():
            return  # already stopping
        stop.set()
        if not serving:
            raise KeyboardInterrupt  # leaves start(), which stops what it started

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    print(f"pagoda: starting the stack of {stack.compose_file}\n  run dir: {stack.run_dir}",
          flush=True)

    def progress(ready: list[str], waiting: list[str]) -> None:
        if waiting:
            print(f"  [{time.monotonic() - started:5.0f} s] {len(ready)}/{len(stack.members)} "
                  f"ready; waiting for {', '.join(waiting)}", flush=True)

    try:
        stack.start(timeout_s=args.startup_timeout, on_progress=progress)
        serving = True
        _print_banner(stack, time.monotonic() - started)
        stack.supervise(stop)
        print("pagoda: stopping", flush=True)
        return 0
    except KeyboardInterrupt:
        print("pagoda: stopped before the stack was ready", flush=True)
        return 0
    except LaunchError as e:
        print(f"pagoda: the launch failed: {e}", flush=True)
        if args.keep_logs:
            print(f"pagoda: logs are in {stack.log_dir}", flush=True)
        return 1
    finally:
        stack.stop()


def _print_banner(stack, elapsed_s: float) -> None:
    names = ", ".join(m.name for m in stack.members)
    lines = [f"pagoda: ready in {elapsed_s:.0f} s ({names})"]
    if stack.gateway_url:
        lines.append(f"  HTTP      {stack.gateway_url}/v1  (OpenAI-compatible)")
    config = ("StackConfig()" if StackConfig().run_dir == stack.run_dir
              else f"StackConfig(run_dir={stack.run_dir!r})")
    if stack.replicas > 1:  # a client routes over every replica only if it knows of them
        client = (f"config = {config}; config.use_replicas({stack.replicas}); "
                  f"AsyncEngineClient(config)")
    else:
        client = ("AsyncEngineClient()" if config == "StackConfig()"
                  else f"AsyncEngineClient({config})")
    if stack.replicas > 1:
        lines.append(f"  engines   {stack.replicas} replicas (data parallel), requests go to the "
                     f"least loaded")
    lines += [f"  run dir   {stack.run_dir}",
              f"  requests  {stack.stack_config.request_input}  ({client})",
              f"  logs      {stack.log_dir}"]
    if stack.curve is not None:
        lines.append(f"  CurveZMQ  keys in {stack.curve.keys_dir} (a client needs "
                     f"PAGODA_CURVE_KEYS_DIR={stack.curve.keys_dir})")
    lines.append("Ctrl-C stops the stack.")
    print("\n".join(lines), flush=True)
