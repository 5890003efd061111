"""`engine serve --ray`: deploy the application (app.py) on a Ray cluster and serve until SIGINT / SIGTERM.

Without an address, Ray starts a cluster of this machine alone for the command's lifetime; with one (`auto`, or
HOST:6379 of a `ray start --head`), the replicas spread over that cluster's nodes. Ray's HTTP proxy binds
host:port on every node that runs one (the head's, at least), with proxy_guard.py's middleware when the cluster
is started here. On a signal the application is deleted, which lets
each replica drain for up to its shutdown timeout, and a cluster started here is stopped.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve

from .app import APP_NAME, NO_ACCESS_LOG, build_application
from .config import ClusterConfig, ReplicaConfig
from .proxy_guard import PROXY_CALLBACK_ENV, PROXY_CALLBACK

log = logging.getLogger("engine.replicas")


def serve_on_ray(replica: ReplicaConfig, cluster: ClusterConfig) -> int:
    server = replica.server
    started_here = not ray.is_initialized() and cluster.ray_address is None
    if not ray.is_initialized():
        # Ray's proxy, started by this cluster, reads its middlewares from the environment it inherits; a cluster
        # started elsewhere needs the variable on its own `ray start` (docs/scale-out.md).
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        ray.init(address=cluster.ray_address)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:   # ours from here on, in place of ray.init's: a signal while deploying also ends in the clean stop below
        serve.start(http_options={"host": server.host, "port": server.port,
                                  "keep_alive_timeout_s": server.http.keep_alive_timeout_s},
                    logging_config=NO_ACCESS_LOG)
        serve.run(build_application(replica, cluster), name=APP_NAME, route_prefix="/")
        log.info("serving %s on http://%s:%d with %s", server.served_model_name, server.host, server.port,
                 f"{cluster.min_replicas}-{cluster.max_replicas} replicas" if cluster.autoscaling
                 else f"{cluster.replicas} replica(s)")
        while not stop.wait(1.0):
            pass
        serve.delete(APP_NAME)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started_here:
            serve.shutdown()
            ray.shutdown()
    return 0
