"""`engine serve --ray`: data-parallel replicas of the HTTP server on Ray Serve, with prefix-aware routing.

    from engine.runtime.replicas.app import build_application, build_app     # imports Ray
    from engine.runtime.replicas.run import serve_on_ray                     # the CLI's blocking run

    app.py           the application: an Ingress deployment before N LLMReplica deployments; build_app for `serve run`
    run.py           deploy on a Ray cluster (started here, or at an address) and serve until a signal
    config.py        ReplicaConfig (the server's config and the LLM's options), ClusterConfig (replicas, routing)
    ingress.py       takes every request from Ray's proxy and forwards it whole to one replica; /metrics, /health
    replica.py       one replica: the server's own app (runtime/server/) fed through asgi_bridge.py
    router.py        Ray Serve's request router: prefix affinity with bounded loads
    affinity.py      that policy, without Ray: owner of the longest matched prefix, else the least loaded
    prefix_key.py    a request's leading chunk hashes, which the router matches
    asgi_bridge.py   one buffered request through an ASGI app, the response as a stream of messages
    metrics_merge.py every replica's Prometheus text as one, labelled by replica

Ray is an optional dependency (the [ray] extra): only app.py, run.py, ingress.py, replica.py and router.py import
it, and nothing outside this package imports them but `engine serve --ray`. The server (runtime/server/) does not
know this package exists.
"""
