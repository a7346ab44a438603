"""Reading docker-compose.yml: the `pagoda ...` services, their command lines and environment.

The compose file is the one description of the stack; `pagoda serve` starts the same command
lines as local processes. Only what the launcher needs is read (`command`, `environment`), with
compose's variable interpolation (`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `$VAR`, `$$`)
from the environment and an `.env` file beside the compose file. Several files are merged as
`docker compose -f a.yml -f b.yml` merges them (a later file's command replaces, its environment
adds to and overrides), and a service's `extends` (same file or another) is followed.
"""
import os
import re
import shlex
from dataclasses import dataclass, field

import yaml

_VARIABLE = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")


def default_compose_file() -> str:
    """The project's docker-compose.yml (beside the `ops/` package)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docker-compose.yml")


def interpolate(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        current = env.get(name)
        if op == ":-" and not current:
            return default
        if op == "-" and current is None:
            return default
        return current or ""
    return _VARIABLE.sub(value, text)


def read_dotenv(path: str) -> dict[str, str]:
    """KEY=VALUE lines of an `.env` file (what compose reads for interpolation)."""
    values = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#") and "=" in line:
                    key, val = line.split("=", 1)
                    values[key.strip()] = val.strip().strip("'\"")
    return values


@dataclass
class ServiceSpec:
    """One compose service that runs a `pagoda` subcommand."""
    name: str  # the compose service name
    command: str  # the pagoda subcommand: engine, worker, tokenizer, detokenizer, gateway
    args: list[str]  # what follows `pagoda <command>` on the command line
    environment: dict[str, str] = field(default_factory=dict)


def load_services(path: str | list[str],
                  env: dict[str, str] | None = None) -> dict[str, ServiceSpec]:
    """The compose file's `pagoda` services, interpolated; other services (monitoring) are left
    out. `path` may list several files, merged in order (the `.env` is the first one's)."""
    paths = [path] if isinstance(path, str) else list(path)
    env = {**read_dotenv(os.path.join(os.path.dirname(os.path.abspath(paths[0])), ".env")),
           **(os.environ if env is None else env)}
    merged: dict[str, dict] = {}
    for p in paths:
        for name, service in _read_services(p).items():
            merged[name] = _merge(merged.get(name, {}), _extended(service, p))
    services = {}
    for name, service in merged.items():
        command = service.get("command")
        if command is None:
            continue
        argv = (shlex.split(interpolate(command, env)) if isinstance(command, str)
                else [interpolate(str(a), env) for a in command])
        if len(argv) < 2 or argv[0] != "pagoda":
            continue
        services[name] = ServiceSpec(name, argv[1], argv[2:],
                                     _environment(service.get("environment"), env))
    return services


def _read_services(path: str) -> dict[str, dict]:
    with open(path) as f:
        return (yaml.safe_load(f) or {}).get("services") or {}


def _extended(service: dict, path: str, depth: int = 0) -> dict:
    """A service with what its `extends` names merged under it."""
    ext = service.get("extends")
    if not ext:
        return service
    if depth > 8:
        raise ValueError(f"{path}: `extends` nested too deep")
    if isinstance(ext, str):
        ext = {"service": ext}
    source = os.path.join(os.path.dirname(os.path.abspath(path)), ext["file"]) if ext.get(
        "file") else path
    base = _extended(_read_services(source)[ext["service"]], source, depth + 1)
    return _merge(base, {k: v for k, v in service.items() if k != "extends"})


def _merge(base: dict, override: dict) -> dict:
    """`override` over `base` for what is read here: the environment merged by key, the rest
    replaced."""
    out = {**base, **override}
    if "environment" in base and "environment" in override:
        out["environment"] = {**_raw_map(base["environment"]),
                              **_raw_map(override["environment"])}
    return out


def _raw_map(raw) -> dict:
    if isinstance(raw, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return dict(raw or {})


def _environment(raw, env: dict[str, str]) -> dict[str, str]:
    """A service's `environment` as a dict (compose allows a map or a list of KEY=VALUE)."""
    if not raw:
        return {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    out = {}
    for key, val in raw.items():
        if val is None:  # `KEY:` alone passes the host's value through
            if key in env:
                out[key] = env[key]
        else:
            out[key] = interpolate(str(val), env)
    return out
