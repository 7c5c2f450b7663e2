"""The endpoint bridge's own waits: finding a job's endpoint actor is bounded and names the job."""

from __future__ import annotations

import asyncio
import time

import pytest

from api.errors import APIError
from api.routes import openai_endpoint as openai_bridge


def test_an_actor_lookup_that_hangs_is_a_503_naming_the_job(monkeypatch):
    def hanging_lookup(name: str):
        time.sleep(1.0)  # Ray's control store not answering; had the bridge waited, this error would show
        raise AssertionError("the bridge should have stopped waiting")

    monkeypatch.setattr(openai_bridge.ray, "get_actor", hanging_lookup)
    monkeypatch.setattr(openai_bridge, "LOOKUP_TIMEOUT_S", 0.2)
    with pytest.raises(APIError) as caught:
        asyncio.run(openai_bridge.call("job-x", "chat", {}))
    err = caught.value
    assert err.status == 503
    assert "job-x" in str(err.message) and "not found within" in str(err.message)
    assert "job-x" not in openai_bridge._servers
