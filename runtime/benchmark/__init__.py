"""`engine bench`: the in-process load generator that measures an engine through the Python API.

    runner.py   run_benchmark: throughput and latency modes over LLM.generate_async, memory, the report
    dataset.py  the requests it sends: synthetic token ids or a JSON Lines file, checked before the engine loads
    stats.py    per-request token timestamps -> TTFT / TPOT / ITL distributions and throughputs (pure functions)

The engine core (runtime/) never imports this package.
"""
