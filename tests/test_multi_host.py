"""The recipe of docs/multi-host.md, run on one machine: each service on a loopback address of
its own (Linux routes all of 127/8 to lo), as if on five hosts, every socket on tcp with CURVE
keys. Each process gets the settings the recipe's env blocks give its host (read from the doc
itself, host names and ports mapped to these addresses and free ports), its own copy of the key
directory and its own, empty run directory, so nothing can pass between them through files.

Then: a completion through the gateway with the official `openai` client; `pagoda health
--service NAME` answers on each host with its keys; a peer without the keys, or with a key
nobody authorized, gets no answer.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import zmq

from ops.launch_plan import engine_arg_flags
from ops.service_process import LaunchError, ServiceProcess, die_with_parent, signal_group
from proto.codec import encode
from proto.requests import GenerateRequest
from shared.curve import create_keys, load_keys
from shared.model_source import DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams
from shared.sockets import probe_health
from tests.test_compose import argv_of, compose_config, parser_for
from tests.test_curve import stranger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "multi-host.md")
PAGODA = os.path.join(os.path.dirname(sys.executable), "pagoda")  # the installed command
# The doc's host names -> the loopback address standing in for each host.
HOSTS = {"ENGINE_HOST": "127.0.0.1", "TOKENIZER_HOST": "127.0.0.2", "GATEWAY_HOST": "127.0.0.3",
         "DETOKENIZER_HOST": "127.0.0.4", "WORKER_HOST": "127.0.0.5"}
SERVICES = ("engine", "worker", "tokenizer", "detokenizer", "gateway")
DOC_KEYS_DIR = "/etc/pagoda/keys"
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": 512}
PROMPT = "The capital of France is"
REFUSED = "refused a ZeroMQ peer without an authorized CURVE key"  # shared.curve's warning


def env_blocks(path: str = DOC) -> dict[str, dict[str, str]]:
    """The doc's env files: each ```sh block whose first line is `# NAME.env...`."""
    with open(path) as f:
        text = f.read()
    blocks = {}
    for body in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        lines = body.splitlines()
        name = re.match(r"# ([\w-]+)\.env\b", lines[0]) if lines else None
        if name:
            blocks[name[1]] = dict(line.split("=", 1) for line in lines[1:]
                                   if line.strip() and not line.startswith("#"))
    return blocks


class Ports:
    """A free tcp port of a loopback address for each (doc host, doc port); the probe sockets
    stay open until `release`, so no two picks are the same port."""

    def __init__(self):
        self.picked: dict[tuple[str, int], int] = {}
        self._probes: list[socket.socket] = []

    def __call__(self, ip: str, doc_port: int) -> int:
        if (ip, doc_port) not in self.picked:
            probe = socket.socket()
            probe.bind((ip, 0))
            self._probes.append(probe)
            self.picked[ip, doc_port] = probe.getsockname()[1]
        return self.picked[ip, doc_port]

    def release(self) -> None:
        for probe in self._probes:
            probe.close()


def localize(settings: dict[str, str], ports: Ports, keys_dir: str) -> dict[str, str]:
    """The doc's settings for one host, with its host names as loopback addresses, its ports as
    free ports and its key directory as this host's copy."""
    def tcp(m: re.Match) -> str:
        ip = HOSTS[m[1]]
        return f"tcp://{ip}:{ports(ip, int(m[2]))}"

    out = {}
    for key, value in settings.items():
        value = re.sub(r"tcp://([A-Z_]+):(\d+)", tcp, value)
        value = HOSTS.get(value, value)
        out[key] = keys_dir if value == DOC_KEYS_DIR else value
    return out


class Host:
    def __init__(self, service: str, folder: str, env: dict[str, str]):
        self.service = service
        self.ip = HOSTS[service.upper() + "_HOST"]
        self.folder = folder
        self.run_dir = os.path.join(folder, "run")
        self.env = env  # only the recipe's settings and this host's run directory


class HostProcesses:
    """One process per host, started as the recipe says (`pagoda <service>` with its host's
    settings only), with the launcher's spawning (own session, ended with this process) and
    log tails; ready once every probe says ok and the engine counts each peer."""

    def __init__(self, hosts: dict[str, Host], http_port: int, log_dir: str):
        self.hosts = hosts
        engine = hosts["engine"].env
        self.curve = load_keys(engine["PAGODA_CURVE_KEYS_DIR"])  # for this test's own probes
        self.engine_control = engine["PAGODA_ENGINE_CONTROL"]
        self.gateway_url = f"http://{hosts['gateway'].ip}:{http_port}"
        os.makedirs(log_dir)
        base = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
        flags = [token for _, tokens in engine_arg_flags(ENGINE_ARGS) for token in tokens]
        self.members = []
        for service, host in hosts.items():
            argv = [PAGODA, service, *flags]
            if service == "gateway":
                argv += ["--host", host.ip, "--port", str(http_port)]
            self.members.append(ServiceProcess(
                service=service, index=0, argv=argv,
                env={**base, **host.env, "PYTHONUNBUFFERED": "1"},
                log_path=os.path.join(log_dir, f"{service}.log"),
                control_addr=host.env.get("PAGODA_CONTROL_ADDR", self.engine_control)))

    def start(self, timeout_s: float) -> None:
        for m in self.members:
            with open(m.log_path, "ab") as log_file:
                m.popen = subprocess.Popen(m.argv, env=m.env, stdin=subprocess.DEVNULL,
                                           stdout=log_file, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            exited = [m.name for m in self.members if m.popen.poll() is not None]
            if exited or time.monotonic() > deadline:
                # Which host failed is seldom the one that shows it: quote them all.
                tails = "\n".join(f"--- {m.name} ---\n{m.log_tail(15)}" for m in self.members)
                raise LaunchError(", ".join(exited) or "stack",
                                  "exited" if exited else f"not ready in {timeout_s:.0f} s", tails)
            time.sleep(0.5)

    def _ready(self) -> bool:
        for m in self.members:
            if not m.healthy:
                health = probe_health(m.control_addr, 0.5, curve=self.curve)
                m.healthy = health is not None and health.status == "ok"
        if not all(m.healthy for m in self.members):
            return False
        details = probe_health(self.engine_control, 0.5, curve=self.curve).details
        return all(details.get(peer, 0) >= 1 for peer in ("tokenizers", "detokenizers", "workers",
                                                         "gateways"))

    def stop(self) -> None:
        running = [m for m in self.members if m.popen is not None and m.popen.poll() is None]
        for m in running:
            signal_group(m.popen, signal.SIGTERM)
        for m in running:
            try:
                m.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                signal_group(m.popen, signal.SIGKILL)
                m.popen.wait()


@pytest.fixture(autouse=True)
def no_process_keys(monkeypatch):
    """This test process holds no keys: a probe is keyed only where a test says so."""
    monkeypatch.delenv("PAGODA_CURVE_KEYS_DIR", raising=False)


@pytest.fixture(scope="module")
def stack():
    root = tempfile.mkdtemp(prefix="pmh-", dir="/tmp")
    keys = create_keys(os.path.join(root, "keys"))
    blocks = env_blocks()
    ports = Ports()
    hosts = {}
    for service in SERVICES:
        folder = os.path.join(root, service)
        os.makedirs(os.path.join(folder, "run"))
        shutil.copytree(keys.keys_dir, os.path.join(folder, "keys"))  # "the same copy"
        settings = {**blocks["stack"], **blocks.get(service, {})}
        env = localize(settings, ports, os.path.join(folder, "keys"))
        hosts[service] = Host(service, folder, {**env, "PAGODA_RUN_DIR": os.path.join(folder, "run")})
    http_port = ports(HOSTS["GATEWAY_HOST"], 8000)
    ports.release()
    launched = HostProcesses(hosts, http_port, os.path.join(root, "logs"))
    try:
        launched.start(timeout_s=120)
        yield launched
    finally:
        launched.stop()
        shutil.rmtree(root, ignore_errors=True)


def pagoda_health(host: Host, keyed: bool = True, timeout_s: float = 3.0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.update(host.env)
    if not keyed:
        env.pop("PAGODA_CURVE_KEYS_DIR")
    return subprocess.run([PAGODA, "health", "--service", host.service, "--json", "--timeout",
                           str(timeout_s)], env=env, capture_output=True, text=True,
                          timeout=30 + timeout_s)


def engine_details(stack) -> dict:
    return probe_health(stack.engine_control, 5.0, curve=stack.curve).details


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs a process listens on, from /proc (IPv4)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].split(":")
                ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                out.add((ip, int(port, 16)))
    return out


def test_the_doc_gives_every_host_its_settings():
    blocks = env_blocks()
    assert {"stack", "tokenizer", "detokenizer", "worker", "gateway"} <= set(blocks)
    assert blocks["stack"]["PAGODA_CURVE_KEYS_DIR"] == DOC_KEYS_DIR
    for key in ("REQUEST_INPUT", "TOKENIZER_INPUT", "ENGINE_INPUT", "WORKER_ADDR",
                "DETOKENIZER_ADDR", "ENGINE_CONTROL"):
        assert blocks["stack"]["PAGODA_" + key].startswith("tcp://ENGINE_HOST:"), key
    for service in ("tokenizer", "detokenizer", "worker", "gateway"):
        host = service.upper() + "_HOST"
        assert blocks[service]["PAGODA_CONTROL_ADDR"].startswith(f"tcp://{host}:"), service
    assert blocks["gateway"]["PAGODA_RETURN_HOST"] == "GATEWAY_HOST"
    assert blocks["worker-group"]["PAGODA_DIST_INIT_ADDR"] == "tcp://WORKER_HOST:29500"


def test_the_engine_binds_and_every_other_process_listens_on_its_own_host_only(stack):
    engine_ports = {int(v.rsplit(":", 1)[1]) for k, v in stack.hosts["engine"].env.items()
                    if v.startswith("tcp://")}
    assert len(engine_ports) == 6
    for m in stack.members:
        host = stack.hosts[m.service]
        bound = listening(m.popen.pid)
        assert {ip for ip, _ in bound} == {host.ip}, (m.name, bound)
        ports = {port for _, port in bound}
        if m.service == "engine":
            assert ports == engine_ports
        else:
            control = int(host.env["PAGODA_CONTROL_ADDR"].rsplit(":", 1)[1])
            # The gateway also serves HTTP and takes results on its return address.
            expected = 3 if m.service == "gateway" else 1
            assert control in ports and len(ports) == expected, (m.name, ports)
            assert not ports & engine_ports


def test_a_completion_through_the_gateway_with_the_openai_client(stack):
    before = engine_details(stack)["generation_tokens"]
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    assert stack.gateway_url.startswith("http://127.0.0.3:")
    out = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    details = engine_details(stack)
    assert details["generation_tokens"] - before == 6  # this engine ran it
    assert (details["tokenizers"], details["detokenizers"], details["workers"],
            details["gateways"]) == (1, 1, 1, 1)
    # Every socket was tcp: no process wrote anything into its run directory.
    for host in stack.hosts.values():
        assert os.listdir(host.run_dir) == [], host.service


def test_each_hosts_health_probe_answers_with_its_keys(stack):
    with ThreadPoolExecutor(len(stack.hosts)) as pool:
        done = dict(zip(stack.hosts, pool.map(pagoda_health, stack.hosts.values())))
    for service, out in done.items():
        assert out.returncode == 0, (service, out.stdout, out.stderr)
        answer = json.loads(out.stdout)
        assert answer["service"] == service and answer["status"] == "ok"
        assert answer["addr"].startswith(f"tcp://{stack.hosts[service].ip}:"), answer


def test_a_peer_without_the_keys_gets_no_answer(stack):
    with ThreadPoolExecutor(len(stack.hosts)) as pool:
        done = dict(zip(stack.hosts, pool.map(lambda h: pagoda_health(h, keyed=False,
                                                                      timeout_s=1.0),
                                              stack.hosts.values())))
    for service, out in done.items():
        assert out.returncode == 1 and "no answer" in out.stdout, (service, out.stdout)

    # A valid request pushed in the clear to the engine's front door never runs.
    before = engine_details(stack)["generation_tokens"]
    ctx = zmq.Context()
    try:
        results = ctx.socket(zmq.PULL)
        results.setsockopt(zmq.LINGER, 0)
        port = results.bind_to_random_port("tcp://127.0.0.6")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(stack.hosts["gateway"].env["PAGODA_REQUEST_INPUT"])
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        push.send(encode(GenerateRequest("plain-1", f"tcp://127.0.0.6:{port}", PROMPT, params,
                                         time.time())))
        assert not results.poll(2000)
    finally:
        ctx.destroy(linger=0)
    assert engine_details(stack)["generation_tokens"] == before


def test_a_peer_with_a_key_nobody_authorized_gets_no_answer(stack):
    """A keyless peer fails at the mechanism; one that knows the server's public key but holds
    a client key of its own gets as far as the ZAP check, and each process refuses it there."""
    outsider = stranger(stack.curve)
    members = stack.members
    with ThreadPoolExecutor(len(members)) as pool:
        answers = list(pool.map(lambda m: probe_health(m.control_addr, 1.0, curve=outsider),
                                members))
    assert answers == [None] * len(members)
    for m in members:
        with open(m.log_path) as f:
            assert REFUSED in f.read(), m.name


# -- a 2-rank worker group in compose (docker-compose.tp2.yml) ------------------------------------
def test_the_tp2_override_runs_two_ranks_that_meet_at_rank_0():
    env = {"PAGODA_ENGINE_ARGS": "--max-num-seqs 8 --tensor-parallel-size 1"}
    base = compose_config(env=env)
    config = compose_config("docker-compose.yml", "docker-compose.tp2.yml", env=env)
    services = config["services"]
    assert set(services) == set(base["services"]) | {"worker-1"}
    for name in ("engine", "worker", "worker-1"):
        parsed = parser_for("worker" if name.startswith("worker") else name).parse_args(
            argv_of(services[name])[2:])
        assert parsed.tensor_parallel_size == 2, name  # after PAGODA_ENGINE_ARGS, so it wins
        assert parsed.max_num_seqs == 8, name  # and the engine arguments still reach it
    ranks = {name: parser_for("worker").parse_args(argv_of(services[name])[2:]).rank
             for name in ("worker", "worker-1")}
    assert ranks == {"worker": 0, "worker-1": 1}
    assert argv_of(services["worker-1"])[:2] == ["pagoda", "worker"]

    rank0, rank1 = services["worker"], services["worker-1"]
    for rank in (rank0, rank1):
        init = rank["environment"]["PAGODA_DIST_INIT_ADDR"]
        host, port = init[len("tcp://"):].rsplit(":", 1)
        assert init.startswith("tcp://") and host == "worker" and int(port) == 29500
    # Rank 1 is a worker like rank 0 in all but its rank and CPUs: the same addresses, its own
    # container's control socket and health check, image, network, volumes and restarts.
    differs = {k for k in set(rank0["environment"]) | set(rank1["environment"])
               if rank0["environment"].get(k) != rank1["environment"].get(k)}
    assert differs <= {"PAGODA_CPUS"}, differs
    assert rank1["environment"]["PAGODA_CONTROL_ADDR"] == "tcp://127.0.0.1:5590"
    for key in ("image", "networks", "volumes", "restart", "healthcheck", "depends_on"):
        assert rank1[key] == rank0[key], key
    assert not rank1.get("ports")
    # The rest of the stack is the base file's.
    for name in ("gateway", "tokenizer", "detokenizer"):
        for key in ("command", "environment", "image"):
            assert services[name][key] == base["services"][name][key], (name, key)


def test_the_tp2_override_gives_each_rank_its_own_cpus():
    env = {"PAGODA_WORKER_CPUS": "0-3", "PAGODA_WORKER_1_CPUS": "4-7"}
    services = compose_config("docker-compose.yml", "docker-compose.tp2.yml", env=env)["services"]
    assert services["worker"]["environment"]["PAGODA_CPUS"] == "0-3"
    assert services["worker-1"]["environment"]["PAGODA_CPUS"] == "4-7"
    assert services["worker-1"]["environment"]["PAGODA_NICE"] == ""
