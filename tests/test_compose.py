"""docker-compose.yml, as docker-compose itself reads it (`docker-compose config`, offline)."""
import argparse
import os
import shlex
import shutil
import subprocess

import pytest
import yaml

from ops import health_cli
from ops.compose import default_compose_file, load_services
from pagoda.cli import COMMANDS
from shared.stack_config import StackConfig

ROOT = os.path.dirname(default_compose_file())
SERVICES = {"gateway", "tokenizer", "engine", "worker", "detokenizer"}
ADDRESS_ENV = ("PAGODA_REQUEST_INPUT", "PAGODA_TOKENIZER_INPUT", "PAGODA_ENGINE_INPUT",
               "PAGODA_WORKER_ADDR", "PAGODA_DETOKENIZER_ADDR", "PAGODA_ENGINE_CONTROL")


def compose_config(*files: str, env: dict[str, str] | None = None, cwd: str = ROOT) -> dict:
    binary = shutil.which("docker-compose")
    assert binary, ("docker-compose is not installed: `apt-get install -y docker-compose` "
                    "(the tests parse docker-compose.yml with it, offline)")
    args = [binary]
    for f in files or ("docker-compose.yml",):
        args += ["-f", f]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    done = subprocess.run(args + ["config"], cwd=cwd, capture_output=True, text=True,
                          env={**base_env, **(env or {})}, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return compose_config()


def argv_of(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def parser_for(command: str) -> argparse.ArgumentParser:
    import importlib
    parser = argparse.ArgumentParser(prog=f"pagoda {command}", exit_on_error=False)
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def test_compose_file_defines_one_service_per_process_type(config):
    assert set(config["services"]) == SERVICES


def test_every_service_runs_its_own_pagoda_command(config):
    for name, service in config["services"].items():
        assert argv_of(service)[:2] == ["pagoda", name]


def test_commands_parse_with_the_services_own_flags(config):
    for name, service in config["services"].items():
        parser_for(name).parse_args(argv_of(service)[2:])


def test_gateway_listens_on_all_interfaces_inside_its_container(config):
    args = parser_for("gateway").parse_args(argv_of(config["services"]["gateway"])[2:])
    assert (args.host, args.port) == ("0.0.0.0", 8000)


def test_every_service_is_one_image_built_from_the_dockerfile(config):
    images = {s["image"] for s in config["services"].values()}
    assert images == {"pagoda:latest"}
    for service in config["services"].values():
        assert service["build"]["dockerfile"] == "ops/Dockerfile"
    assert os.path.isfile(os.path.join(ROOT, "ops", "Dockerfile"))


def test_every_service_has_a_health_check_that_runs_pagoda_health(config):
    for name, service in config["services"].items():
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "pagoda", "health"], name
        parser = argparse.ArgumentParser(exit_on_error=False)
        health_cli.add_arguments(parser)
        assert parser.parse_args(test[3:]).service == name


def test_each_health_check_probes_its_own_containers_control_socket(config, monkeypatch):
    for name, service in config["services"].items():
        for key in list(os.environ):
            if key.startswith("PAGODA_"):
                monkeypatch.delenv(key)
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, value)
        stack = StackConfig()
        assert stack.control_for(name) == service["environment"]["PAGODA_CONTROL_ADDR"]
        expected = "tcp://engine:5590" if name == "engine" else "tcp://127.0.0.1:5590"
        assert stack.control_for(name) == expected, name


def test_every_zmq_address_names_the_engine_service(config):
    for name, service in config["services"].items():
        env = service["environment"]
        for key in ADDRESS_ENV:
            assert env[key].startswith("tcp://engine:"), (name, key, env.get(key))
    ports = {config["services"]["engine"]["environment"][k].rsplit(":", 1)[1] for k in ADDRESS_ENV}
    assert len(ports) == len(ADDRESS_ENV)  # one port per socket


def test_gateway_advertises_its_service_name_as_return_address(config):
    assert config["services"]["gateway"]["environment"]["PAGODA_RETURN_HOST"] == "gateway"


def test_zmq_traffic_stays_on_an_internal_network(config):
    assert config["networks"]["stack"]["internal"] is True
    for name, service in config["services"].items():
        networks = set(service["networks"])
        assert "stack" in networks, name
        assert networks == ({"stack", "public"} if name == "gateway" else {"stack"}), name
    assert not config["networks"]["public"].get("internal")


def test_only_the_gateway_publishes_a_port(config):
    published = {name: service.get("ports") for name, service in config["services"].items()
                 if service.get("ports")}
    assert list(published) == ["gateway"]
    [port] = published["gateway"]
    if isinstance(port, dict):  # compose prints the long form
        port = f"{port['published']}:{port['target']}"
    assert str(port) == "8000:8000"


def test_tokenizer_can_be_scaled(config):
    tokenizer = config["services"]["tokenizer"]
    assert "container_name" not in tokenizer  # `--scale tokenizer=4` names each replica
    assert not tokenizer.get("ports")  # replicas would fight over a host port
    assert "hostname" not in tokenizer


def test_every_service_restarts_after_a_failure(config):
    for name, service in config["services"].items():
        assert service["restart"] in ("unless-stopped", "on-failure", "always"), name


def test_the_model_volume_is_mounted_where_models_go(config):
    assert "models" in config["volumes"]
    for name, service in config["services"].items():
        mounts = [str(v) for v in service["volumes"]]
        assert any(m.startswith("models:/models") for m in mounts), (name, mounts)


def test_cpu_stack_reserves_no_gpu(config):
    for service in config["services"].values():
        assert "devices" not in service.get("deploy", {}).get("resources", {}).get("reservations", {})


def test_gpu_override_reserves_an_nvidia_gpu_for_the_worker():
    config = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    for name, service in config["services"].items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if name == "worker":
            assert devices[0]["driver"] == "nvidia"
            assert "gpu" in devices[0]["capabilities"]
            assert "--device" in argv_of(service)
        else:
            assert devices is None, name


def test_monitoring_override_scrapes_the_gateway_and_publishes_on_loopback_only():
    config = compose_config("docker-compose.yml", "docker-compose.monitoring.yml")
    assert {"prometheus", "grafana"} <= set(config["services"])
    for name in ("prometheus", "grafana"):
        for port in config["services"][name]["ports"]:
            # docker-compose 1.x prints "ip:host:container/proto"; 2.x a mapping with host_ip.
            host_ip = port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]
            assert host_ip == "127.0.0.1", (name, port)
    with open(os.path.join(ROOT, "ops", "monitoring", "prometheus.yml")) as f:
        scrape = yaml.safe_load(f)
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["gateway:8000"]
    with open(os.path.join(ROOT, "ops", "monitoring", "grafana-dashboard.json")) as f:
        dashboard = f.read()
    assert "pagoda:time_to_first_token_seconds" in dashboard


def test_engine_args_reach_every_service_through_the_environment():
    config = compose_config(env={"PAGODA_ENGINE_ARGS": "--model /models/m.gguf"})
    for name, service in config["services"].items():
        assert parser_for(name).parse_args(argv_of(service)[2:]).model == "/models/m.gguf", name


def test_launcher_reads_the_same_commands_and_environment_as_docker_compose():
    env = {"PAGODA_ENGINE_ARGS": "--max-num-seqs 8"}
    config = compose_config(env=env)
    services = load_services(default_compose_file(), env=env)
    assert set(services) == SERVICES
    for name, spec in services.items():
        assert ["pagoda", spec.command, *spec.args] == argv_of(config["services"][name])
        assert spec.environment == config["services"][name]["environment"]


def test_launcher_interpolates_variables_like_docker_compose(tmp_path):
    (tmp_path / "docker-compose.yml").write_text(
        "services:\n"
        "  s:\n"
        "    image: x\n"
        "    command: pagoda engine ${A:-a0} ${B-b0} ${C:-c0} ${D-d0} $E x$${F} ${G}\n"
        "    environment:\n"
        "      K: ${E}-k\n"
        "      P:\n")
    (tmp_path / ".env").write_text("G=from-dotenv\n")
    env = {"A": "", "B": "", "E": "e", "P": "passed"}
    config = compose_config(env=env, cwd=str(tmp_path))
    spec = load_services(str(tmp_path / "docker-compose.yml"), env=env)["s"]
    expected = argv_of(config["services"]["s"])
    assert ["pagoda", spec.command, *spec.args] == [a.replace("$$", "$") for a in expected]
    assert spec.args == ["a0", "c0", "d0", "e", "x${F}", "from-dotenv"]
    assert spec.environment == config["services"]["s"]["environment"] == {"K": "e-k", "P": "passed"}
