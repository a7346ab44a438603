"""One `pagoda serve` stack (real processes, real sockets, real HTTP) for every API test of this
folder, reached through the official `openai` client. Outputs are kept short: this runs on CPUs."""
import os
import shutil
import socket
import tempfile

import httpx
import openai
import pytest

from ops.launcher import LocalStack
from shared.model_source import DEFAULT_MODEL_NAME

API_KEY = "api-test-key"
MODEL = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 1024
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32}
# Settings of the stack's services (the compose file's environment variables).
# Chat: the shipped tool template, hermes tool calls and qwen3 <think> spans (tests/api/
# test_tools.py, test_chat_template.py); other tests' outputs are the same with them. Usage
# with its cached prompt tokens (test_extensions.py).
STACK_ENV = {"PAGODA_TRUST_REQUEST_CHAT_TEMPLATE": "true",
             "PAGODA_LIVENESS_TIMEOUT_S": "60", "PAGODA_CHAT_TEMPLATE": "hermes_tools",
             "PAGODA_TOOL_CALL_PARSER": "hermes", "PAGODA_REASONING_PARSER": "qwen3",
             "PAGODA_ENABLE_PROMPT_TOKENS_DETAILS": "true"}

# A second name for the model (--served-model-name MODEL MODEL_ALIAS): requests may use either.
MODEL_ALIAS = "pagoda-test-alias"
STACK_ENV["PAGODA_SERVED_MODEL_NAME"] = f"{MODEL} {MODEL_ALIAS}"
# Placement as `pagoda serve --worker-cpus ... --service-nice 1` sets it (test_placement.py):
# the worker's OpenMP threads bound one to each CPU this machine gives, the light services one
# nice step down.
PLACEMENT_VARS = {"PAGODA_WORKER_CPUS": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
                  "PAGODA_SERVICE_NICE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")  # stopped after the folder's last test, not at the end
def api_stack():
    root = tempfile.mkdtemp(prefix="papi-", dir="/tmp")  # short: ipc paths have a length limit
    stack = LocalStack(engine_args=ENGINE_ARGS, run_dir=os.path.join(root, "stack"),
                       port=_free_port(), api_key=API_KEY, env=STACK_ENV,
                       compose_vars=PLACEMENT_VARS)
    try:
        stack.start(timeout_s=300)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(api_stack):
    return openai.OpenAI(base_url=api_stack.gateway_url + "/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


@pytest.fixture
def aclient(api_stack):
    return openai.AsyncOpenAI(base_url=api_stack.gateway_url + "/v1", api_key=API_KEY,
                              max_retries=0, timeout=120)


@pytest.fixture
def http(api_stack):
    """Plain HTTP, for endpoints and fields the `openai` client has no method for."""
    with httpx.Client(base_url=api_stack.gateway_url,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
