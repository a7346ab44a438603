"""The fault suite's stack (one for the whole suite: starting it is the slow part) and its
fault-free baseline."""
import asyncio
import tempfile

import pytest

from ops.launcher import LocalStack
from tests.faults.stack_faults import (ENGINE_ARGS, HANG_TIMEOUT_S, KEEP_LOGS, LIVENESS_S,
                                       MAX_TOKENS, STEP_TIMEOUT_S, StreamResult,
                                       SupervisedStack, free_port, new_client, run_requests)


@pytest.fixture(scope="session")
def stack():
    run_dir = tempfile.mkdtemp(prefix="pflt-", dir="/tmp")  # ipc paths have a length limit
    supervised = SupervisedStack(LocalStack(
        engine_args=ENGINE_ARGS, tokenizers=2, detokenizers=2, run_dir=run_dir,
        port=free_port(), env={"PAGODA_LIVENESS_TIMEOUT_S": str(LIVENESS_S),
                               "PAGODA_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S)},
        keep_logs=KEEP_LOGS, hang_timeout_s=HANG_TIMEOUT_S,
        max_restarts_per_minute=10))  # the tests kill processes on purpose, often
    supervised.start()
    if KEEP_LOGS:
        print(f"\nfault stack logs in {run_dir}/logs")
    yield supervised
    supervised.stop()


@pytest.fixture(scope="session")
def baseline(stack) -> list[StreamResult]:
    """The same requests through the same stack, with no fault."""
    async def main():
        client = new_client(stack)
        try:
            return await run_requests(client, "baseline")
        finally:
            client.close()
    results = asyncio.run(main())
    for r in results:
        assert r.error is None and r.finish_reason == "length", r
        assert len(r.token_ids) == MAX_TOKENS and r.text
    return results
