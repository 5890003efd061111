"""`engine serve --ray`: data-parallel replicas of the HTTP server on Ray Serve, with prefix-aware routing.

    from engine.runtime.replicas.app import build_application, build_app     # imports Ray
    from engine.runtime.replicas.run import serve_on_ray                     # the CLI's blocking run

    app.py           the application: N LLMReplica replicas, each its own HTTP ingress; build_app for `serve run`
    run.py           deploy on a Ray cluster (started here, or at an address) and serve until a signal
    config.py        ReplicaConfig (the server's config and the LLM's options), ClusterConfig (replicas, routing)
    replica.py       one replica: the server's own app (runtime/server/) behind its front
    front.py         what Ray's proxy calls in a replica: /metrics of all, a request whose prefix another replica
                     owns forwarded there once, the rest to this replica's app
    peers.py         a replica's view of the others: live ones, prefix owners (told by broadcast), the handle
    router.py        Ray Serve's request router: least loaded, or the owner a replica names while not overloaded
    affinity.py      the policy, without Ray: owner of the longest matched prefix, loads bounded
    prefix_key.py    a request's leading chunk hashes, which the owners are kept by
    asgi_bridge.py   one buffered request through an ASGI app, the response as a stream of messages (forwarding)
    proxy_guard.py   a middleware in Ray's proxy: a stream whose replica died ends with an error event
    scope_body.py    a small request body read in Ray's proxy and sent to the replica in the request's scope
    metrics_merge.py every replica's Prometheus text as one, labelled by replica

Ray is an optional dependency (the [ray] extra): only app.py, run.py, replica.py, front.py, peers.py and router.py
import it, and nothing outside this package imports them but `engine serve --ray`. The server (runtime/server/) does not
know this package exists.
"""
