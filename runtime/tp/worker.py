"""Ranks 1..N-1 of a tp > 1 engine: load this rank's shard, then loop — receive a step, run the shard with its
all-reduces, send the logits columns to rank 0 — until rank 0 says shut down.

    serve_rank(engine_dir, dist, threads)         torchrun-style (cli/ calls it when RANK > 0)
    python -m engine.runtime.tp.worker --engine-dir D --rank R --world-size N --master-port P ...   spawned by
                                                  rank 0 (runtime/tp/session.py)

A worker holds no scheduler and samples nothing. Any failure (its own, or a collective that fails because another
rank died or fell silent for the timeout) ends it with a message naming its rank and exit status 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from engine.core.errors import EngineError

from ..engine_dir import load_engine_config
from ..step_inputs import make_step_inputs, max_attention_rows
from . import protocol
from .distributed import DistributedConfig
from .group import ERROR, NUM_BLOCKS, READY, Group, open_store
from .shard import open_shard


def serve_rank(engine_dir: Path, dist: DistributedConfig, threads: int | None = None) -> None:
    """Run rank `dist.rank` (> 0) until rank 0 shuts the engine down; EngineError on any failure."""
    engine_dir = Path(engine_dir)
    config = load_engine_config(engine_dir)
    dist.check(config.mapping.tp_size, str(engine_dir))
    assert dist.rank > 0, "rank 0 runs the scheduler (runtime/tp/session.py)"
    store = open_store(dist)
    try:
        num_blocks = int(store.get(NUM_BLOCKS))
        shard = open_shard(engine_dir, config, dist.rank, num_blocks=num_blocks, threads=threads)
    except Exception as e:
        try:
            store.set(ERROR.format(dist.rank), str(e) or type(e).__name__)
        except Exception:  # rank 0 is gone too; the message below still says why
            pass
        if isinstance(e, RuntimeError):  # the store timed out: rank 0 never published the pool size
            raise EngineError(f"tensor-parallel rank {dist.rank}: rank 0 did not answer within "
                              f"{dist.timeout_s:g} s ({e})") from None
        raise
    store.set(READY.format(dist.rank), "ok")
    shard.join(store, dist.world_size)
    group = Group(store, dist)
    model, tpb = config.model, config.build.tokens_per_block
    sliding = model.sliding_window if "sliding" in model.layer_types else None
    rows = max_attention_rows(config)
    while True:
        head = group.header(None, protocol.HEADER_SIZE)
        command = int(head[0])
        if command == protocol.SHUTDOWN:
            return
        if command == protocol.PING:
            continue
        if command != protocol.STEP:
            raise EngineError(f"tensor-parallel rank {dist.rank}: unknown command {command} from rank 0")
        payload = np.empty(protocol.payload_size(head), dtype=np.int64)
        group.broadcast(payload)
        inputs = make_step_inputs(protocol.decode(head, payload), tpb, sliding, rows)
        group.gather(shard.run(inputs, group.all_reduce))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.runtime.tp.worker", description=__doc__)
    p.add_argument("--engine-dir", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    dist = DistributedConfig(rank=a.rank, world_size=a.world_size, master_addr=a.master_addr,
                             master_port=a.master_port, timeout_s=a.timeout, spawn=False)
    try:
        serve_rank(a.engine_dir, dist, a.threads)
    except EngineError as e:
        print(f"engine: error: tensor-parallel rank {a.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
