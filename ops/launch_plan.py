"""The launch plan: which processes a LocalStack starts, with which arguments and environment.

A compose service whose command is `pagoda <service> ...` becomes `counts[service]` processes
(one where the stack does not count the service), the engine and worker services that many per
engine replica. Each gets the compose file's arguments and environment, the launch's engine
arguments that its command accepts, the launcher's socket addresses, and a worker its share of
the CPUs.
"""
import os
import sys
from dataclasses import fields

from shared.engine_args import EngineArgs
from shared.placement import parse_cpu_list, rank_cpus
from shared.sockets import free_tcp_ports
from shared.stack_config import StackConfig
from ops.compose import ServiceSpec
from ops.service_process import LaunchError, ServiceProcess

# StackConfig fields that name sockets or hosts of one deployment; the launcher sets its own.
_LOCAL_FIELDS = ("run_dir", "request_input", "tokenizer_input", "engine_input", "worker_addr",
                 "detokenizer_addr", "control_addr", "engine_control", "return_host", "replica",
                 "dist_init_addr")
_LOCAL_ENV = {"PAGODA_" + name.upper() for name in _LOCAL_FIELDS}
# What the launcher's own StackConfig decides for every process (its sockets, and --curve-keys-dir);
# its other fields come from this environment only, so the compose file's values (from `.env`,
# say) win over them.
_LAUNCHER_ENV = _LOCAL_ENV | {"PAGODA_CURVE_KEYS_DIR"}

_PER_REPLICA = ("engine", "worker")  # the services each engine replica has its own of


def local_stack_config(run_dir: str) -> StackConfig:
    """The default ipc layout in `run_dir`, whatever PAGODA_* addresses this environment holds
    (the same file names a bare `StackConfig()` uses, so default clients find the stack)."""
    return StackConfig.ignoring_env(_LOCAL_FIELDS, run_dir=run_dir)


def use_tcp_ports(stack: StackConfig, host: str) -> None:
    """Put the addresses the engine binds on free tcp ports of `host` (clients then return
    over tcp too)."""
    names = ("request_input", "tokenizer_input", "engine_input", "worker_addr",
             "detokenizer_addr", "engine_control")
    ports = iter(free_tcp_ports(host, len(names) * stack.num_replicas))
    for name in names:
        stack.set_replica_addresses(name, [f"tcp://{host}:{next(ports)}"
                                           for _ in range(stack.num_replicas)])
    stack.return_host = host


def engine_arg_flags(engine_args: dict) -> list[tuple[str, list[str]]]:
    """EngineArgs values -> (flag, tokens) pairs; None values are left to each service's default."""
    known = {f.name for f in fields(EngineArgs)}
    out = []
    for name, value in engine_args.items():
        if name not in known:
            raise ValueError(f"unknown engine argument {name!r}")
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append((flag, [flag if value else "--no-" + flag[2:]]))
        else:
            out.append((flag, [flag, str(value)]))
    return out


def accepted_flags(command: str) -> set[str]:
    """The option strings `pagoda <command>` accepts, from its own argument parser."""
    import argparse
    import importlib

    from pagoda.cli import COMMANDS
    if command not in COMMANDS:
        raise LaunchError(command, f"pagoda has no `{command}` command")
    parser = argparse.ArgumentParser(add_help=False)
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return {s for action in parser._actions for s in action.option_strings}


def plan_processes(stack) -> list[ServiceProcess]:
    """Each compose service of `stack` (a LocalStack) as its processes: command line,
    environment, log file and control address. Raises LaunchError when the compose file lacks
    a service the stack needs."""
    specs = stack.specs
    processes = []
    for needed in ("engine", "worker", "tokenizer", "detokenizer"):
        if not any(s.command == needed for s in specs.values()):
            raise LaunchError(needed, f"no service runs `pagoda {needed}` in {stack.compose_file}")
    if stack.gateway and not any(s.command == "gateway" for s in specs.values()):
        raise LaunchError("gateway", f"no service runs `pagoda gateway` in {stack.compose_file}")
    for spec in specs.values():
        count = stack.counts.get(spec.command, 1)
        if count == 0:
            continue
        flags = accepted_flags(spec.command)
        if spec.command not in _PER_REPLICA:
            replicas = [0]
        elif "PAGODA_REPLICA" in spec.environment:  # the file lists its replicas
            replicas = [int(spec.environment["PAGODA_REPLICA"])]
        else:
            replicas = list(range(stack.replicas))
        for replica in replicas:
            for rank in range(count):
                index = (replica - replicas[0]) * count + rank
                processes.append(_process_for(stack, spec, index, flags, replica, rank))
    return processes


def _process_for(stack, spec: ServiceSpec, index: int, flags: set[str], replica: int = 0,
                 rank: int = 0) -> ServiceProcess:
    """Process `index` of `spec` (rank `rank` of engine replica `replica`); `flags`: what its
    command accepts."""
    args = list(spec.args)
    if "--instance" in flags:
        args += ["--instance", str(index)]
    elif "--rank" in flags:
        args += ["--rank", str(rank)]
    else:
        assert rank == 0, f"`pagoda {spec.command}` has no --instance or --rank flag"
    # Later flags win in argparse: the launch's own values override the compose file's.
    for flag, tokens in engine_arg_flags(stack.engine_args):
        if flag in flags or tokens[0] in flags:
            args += tokens
    if spec.command == "gateway":
        args += ["--host", stack.host, "--port", str(stack.port)]
        if stack.api_key:
            args += ["--api-key", stack.api_key]
        if stack.served_model_names:
            args += ["--served-model-name", *stack.served_model_names]
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_ENV}
    env.update({k: v for k, v in spec.environment.items() if k not in _LOCAL_ENV})
    env.update({k: v for k, v in stack.stack_config.to_env().items()
                if k in _LAUNCHER_ENV or k not in env})
    env.update(PYTHONUNBUFFERED="1", **stack.extra_env)
    env["PAGODA_REPLICA"] = str(replica)
    ranks = stack.counts["worker"]
    if spec.command == "worker" and stack.replicas * ranks > 1:
        # Each worker process its own share of the workers' CPUs (those given, else this
        # host's): first by replica, then by rank. Workers whose OpenMP threads share cores
        # wait at every barrier for a preempted peer, and a tensor-parallel group meets at
        # every layer's sum.
        cpus = parse_cpu_list(env.get("PAGODA_CPUS", "").strip()
                              or ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        share = rank_cpus(rank_cpus(cpus, replica, stack.replicas), rank, ranks)
        env["PAGODA_CPUS"] = ",".join(map(str, share))
    if spec.command == "worker" and ranks > 1:
        env["PAGODA_DIST_INIT_ADDR"] = stack.dist_init_addrs[replica]
    instance = rank if spec.command in _PER_REPLICA else index
    return ServiceProcess(
        service=spec.name, index=index,
        argv=[sys.executable, "-m", "pagoda", spec.command, *args], env=env,
        log_path=os.path.join(stack.log_dir, f"{spec.name}-{index}.log"),
        control_addr=stack.stack_config.for_replica(replica).control_for(spec.command,
                                                                         instance),
        replica=replica)


def replica_count(specs: dict[str, ServiceSpec], data_parallel_size: int | None) -> int:
    """How many engine replicas: those the compose file lists (services that set
    PAGODA_REPLICA), else `data_parallel_size`; both given, they must agree."""
    listed = {int(s.environment["PAGODA_REPLICA"]) for s in specs.values()
              if s.command == "engine" and "PAGODA_REPLICA" in s.environment}
    if data_parallel_size is not None and data_parallel_size < 1:
        raise ValueError(f"data_parallel_size: must be at least 1, got {data_parallel_size}")
    if not listed:
        return data_parallel_size or 1
    if listed != set(range(len(listed))):
        raise ValueError(f"the compose file's engine replicas are {sorted(listed)}; "
                         f"they must be 0..{len(listed) - 1}")
    if data_parallel_size not in (None, len(listed)):
        raise ValueError(f"data_parallel_size {data_parallel_size}, but the compose file "
                         f"lists {len(listed)} engine replicas")
    return len(listed)

