"""--scheduling-policy priority: the request's `priority` field reaches the scheduler (lower runs first)."""
from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import RunningServer, first_data_event, slow_steps


def test_priority_orders_waiting_requests(server_engine):
    s = RunningServer(server_engine, scheduling_policy="priority")
    try:
        s.wait_ready()
        done: dict[str, float] = {}

        def short(name: str, priority: int):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": priority},
                           timeout=60)
            assert r.status_code == 200, r.text
            done[name] = time.monotonic()

        with slow_steps(s, 0.01), httpx.Client(base_url=s.url, timeout=60) as c:
            # eight sequences of priority 10 fill the batch (max_batch_size 8) for 100+ steps
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "n": 8, "max_tokens": 100,
                                                           "ignore_eos": True, "priority": 10, "stream": True}) as r:
                lines = r.iter_lines()
                assert first_data_event(lines)["choices"]
                late = threading.Thread(target=short, args=("low", 10))
                late.start()
                time.sleep(0.2)                       # "low" arrives first ...
                urgent = threading.Thread(target=short, args=("high", 0))
                urgent.start()                        # ... "high" outranks it
                urgent.join(timeout=60)
                late.join(timeout=60)
                for _ in lines:
                    pass
        assert set(done) == {"low", "high"}
        assert done["high"] < done["low"], "the priority-0 request did not run before the earlier priority-10 one"
        s.wait_all_free()
    finally:
        s.stop()
