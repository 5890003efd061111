"""Rank 0 of a tp > 1 engine, behind the interface of runtime/session.py (`run(chunks) -> logits`, `config`,
`num_blocks`, `tokens_per_block`), so the scheduler above it is the same as at tp=1.

    TPSession(engine_dir, num_blocks, distributed=None)
        spawn (default): open the store on a free local port, start ranks 1..N-1 as
                         `python -m engine.runtime.tp.worker` subprocesses, load rank 0's shard meanwhile
        torchrun-style:  join the store at MASTER_ADDR:MASTER_PORT; the other ranks are started by the user
        publish num_blocks -> wait until every rank says "ready" (or fails) -> gloo process group
    run(chunks):  step inputs (checked) ─header + payload─▶ ranks 1..N-1 (runtime/tp/protocol.py)
                  every rank runs its shard, all-reducing after o_proj and mlp down ─▶ gather logits columns on rank 0
                  ─▶ [S, vocab_size]
    close():      SHUTDOWN to the workers, which exit 0; called at interpreter exit too

A TensorRT engine's ranks are the same processes with TrtRankShard (runtime/tp/trt_shard.py): each runs one engine
on its own GPU whose DistCollective layers all-reduce over NCCL, and the process group here only carries the steps
and gathers the logits.

Faults. A monitor thread polls the spawned workers every 0.2 s and, while the engine is idle, exchanges a PING with
every rank each timeout/4 seconds (the workers' wait for the next step is bounded by the same timeout). A rank that
dies makes the next collective fail at once (its connection closes); one that hangs makes it fail after the timeout.
Either way run() raises EngineError naming the rank where it is known, every later run() raises the same, the
monitor calls `on_failure(message)` (serve uses it to stop the server), and the workers exit non-zero on their own.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from engine.core.engine_format import EngineConfig
from engine.core.errors import EngineError

from ..engine_dir import load_engine_config, verifying_files
from ..step_inputs import SeqChunk, check_step, make_step_inputs, max_attention_rows
from . import protocol
from .distributed import DistributedConfig
from .group import NUM_BLOCKS, CollectiveError, Group, open_store, wait_for_ranks
from .shard import open_shard

log = logging.getLogger("engine.runtime")

POLL_S = 0.2


class TPSession:
    def __init__(self, engine_dir: Path, *, num_blocks: int, threads: int | None = None,
                 distributed: DistributedConfig | None = None):
        engine_dir = Path(engine_dir)
        self.config: EngineConfig = load_engine_config(engine_dir)
        cfg, build = self.config, self.config.build
        tp = cfg.mapping.tp_size
        if num_blocks < 1:
            raise EngineError(f"num_blocks {num_blocks} must be at least 1")
        dist = distributed or DistributedConfig()
        if dist.spawn:
            dist = dataclasses.replace(dist, rank=0, world_size=tp)
        dist.check(tp, str(engine_dir))
        if dist.rank != 0:
            raise EngineError(f"rank {dist.rank} runs as a worker (runtime/tp/worker.py serve_rank), not a session")
        if threads is None and dist.spawn:
            threads = max(1, (os.cpu_count() or 1) // tp)  # the ranks share this machine's cores
        self.num_blocks, self.tokens_per_block = num_blocks, build.tokens_per_block
        self._sliding = cfg.model.sliding_window if "sliding" in cfg.model.layer_types else None
        self.on_failure: Callable[[str], None] | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._procs: dict[int, subprocess.Popen] = {}
        self._group = None
        self._last_collective = time.monotonic()
        self._timeout_s = dist.timeout_s

        store = open_store(dist)
        try:
            if dist.spawn:
                dist = dataclasses.replace(dist, master_port=store.port)
                self._spawn(engine_dir, dist, threads)
            store.set(NUM_BLOCKS, str(num_blocks))
            with verifying_files(engine_dir, cfg):  # every rank's files against the manifest, hashed meanwhile
                self._shard = open_shard(engine_dir, cfg, 0, num_blocks=num_blocks, threads=threads)
            self.kv_pool = self._shard.kv_pool
            wait_for_ranks(store, dist, alive=self._exit_reason)
            self._shard.join(store, dist.world_size)
            self._group = Group(store, dist)
        except BaseException:
            self._kill_workers()
            raise
        self._store = store
        atexit.register(_close_at_exit, weakref.ref(self))
        self._monitor = threading.Thread(target=self._watch, name="engine-tp-monitor", daemon=True)
        self._monitor.start()

    # ---- steps ------------------------------------------------------------------------------------------------

    def run(self, chunks: list[SeqChunk], *, copy: bool = True) -> np.ndarray:
        """Logits [sum of the chunks' num_logits, vocab_size] float32, in chunk order (a new array whatever
        `copy` says: EngineSession.run's keyword)."""
        self._check_alive()
        inputs = make_step_inputs(chunks, self.tokens_per_block, self._sliding, max_attention_rows(self.config))
        check_step(inputs, chunks, self.config, self.num_blocks)
        head, payload = protocol.encode(chunks)
        with self._lock:
            self._check_alive()
            try:
                self._group.header(head, protocol.HEADER_SIZE)
                self._group.broadcast(payload)
                logits = self._shard.run(inputs, self._group.all_reduce)
                stacked = self._group.gather(logits)
            except CollectiveError as e:
                raise self._fail(str(e)) from None
            finally:
                self._last_collective = time.monotonic()
        rows = stacked.shape[1]
        return stacked.transpose(1, 0, 2).reshape(rows, -1)[:, :self.config.model.vocab_size]

    def close(self) -> None:
        """Shut the workers down (they exit 0) and free the process group; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        acquired = self._lock.acquire(timeout=self._timeout_s)
        try:
            if self._failure is None and self._group is not None and acquired:
                try:
                    self._group.header(protocol.header(protocol.SHUTDOWN), protocol.HEADER_SIZE)
                except CollectiveError:
                    pass
        finally:
            if acquired:
                self._lock.release()
        # Dropping the group closes rank 0's connections: a worker still waiting on it fails at once and exits.
        self._group = None
        deadline = time.monotonic() + 10
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        self._kill_workers()

    @property
    def failure(self) -> str | None:
        """Why the ranks can no longer run steps, or None while they can."""
        return self._failure

    # ---- workers ----------------------------------------------------------------------------------------------

    def _spawn(self, engine_dir: Path, dist: DistributedConfig, threads: int | None) -> None:
        for r in range(1, dist.world_size):
            cmd = [sys.executable, "-m", "engine.runtime.tp.worker", "--engine-dir", str(engine_dir.resolve()),
                   "--rank", str(r), "--world-size", str(dist.world_size), "--master-addr", dist.master_addr,
                   "--master-port", str(dist.master_port), "--timeout", str(dist.timeout_s)]
            if threads:
                cmd += ["--threads", str(threads)]
            self._procs[r] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def _exit_reason(self, rank: int) -> str | None:
        proc = self._procs.get(rank)
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"its process (pid {proc.pid}) {how}"

    def _dead_rank(self) -> str | None:
        for r in sorted(self._procs):
            reason = self._exit_reason(r)
            if reason:
                return f"tensor-parallel rank {r} is gone: {reason}"
        return None

    def _kill_workers(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # ---- faults -----------------------------------------------------------------------------------------------

    def _fail(self, detail: str) -> EngineError:
        """Record the failure (naming the dead rank when a spawned worker exited) and return its error."""
        deadline = time.monotonic() + 1.0  # a closed connection can arrive just before the exit status
        dead = self._dead_rank()
        while dead is None and self._procs and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead_rank()
        message = f"{dead} ({detail})" if dead else detail
        self._set_failure(message)
        return EngineError(self._failure_message())

    def _set_failure(self, message: str) -> None:
        if self._failure is not None:
            return
        self._failure = message
        log.error("tensor-parallel engine failed: %s", message)
        if self.on_failure is not None:
            self.on_failure(self._failure_message())

    def _failure_message(self) -> str:
        return (f"{self._failure}; the tensor-parallel engine cannot run further steps: restart it (every rank "
                "must run)")

    def _check_alive(self) -> None:
        if self._closed.is_set():
            raise EngineError("the tensor-parallel engine was closed")
        if self._failure is not None:
            raise EngineError(self._failure_message())

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            if self._failure is not None:
                return
            dead = self._dead_rank()
            if dead is not None:
                self._set_failure(dead)
                return
            if time.monotonic() - self._last_collective > self._timeout_s / 4 and self._lock.acquire(blocking=False):
                try:
                    if not self._closed.is_set() and self._group is not None:
                        self._group.header(protocol.header(protocol.PING), protocol.HEADER_SIZE)
                except CollectiveError as e:
                    self._fail(str(e))
                    return
                finally:
                    self._last_collective = time.monotonic()
                    self._lock.release()


def _close_at_exit(ref: weakref.ref) -> None:
    session = ref()
    if session is not None:
        session.close()
