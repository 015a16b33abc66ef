"""python -m dasllama.serve.ray --replicas N [the flags of python -m dasllama.serve ...]

Deploys N engine replicas on the Ray cluster that RAY_ADDRESS names (or the one `ray start` left
running here, or a new local one) and serves the OpenAI routes on --host/--port through Serve's
proxy, until interrupted; then it takes the application down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..__main__ import parse_args, unknown_model

log = logging.getLogger("dasllama.serve.ray")
APP_NAME = "dasllama"


def add_ray_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("Ray Serve")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (each loads every --model)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale between --replicas and this many replicas on load (default: a fixed --replicas)")
    g.add_argument("--replica-threads", type=int, default=None, help="kernel threads per replica, and CPUs it reserves (default: DASLLAMA_THREADS, else 1)")
    g.add_argument("--routing", default="prefix", choices=["prefix", "round-robin"], help="prefix: a prompt goes to the replica that served the longest prefix of it; round-robin: each replica in turn")
    g.add_argument("--imbalance", type=int, default=8, help="requests in flight by which the replica holding a prefix may exceed the least loaded one before load wins")


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the Ray flags, the rest: the flags every replica's server takes)."""
    ap = argparse.ArgumentParser(add_help=False)
    add_ray_flags(ap)
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog="python -m dasllama.serve.ray", extra=add_ray_flags)
    ray_args, server_argv = split_argv(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas < 1 or (args.max_replicas is not None and args.max_replicas < args.replicas):
        log.error("--replicas must be at least 1, and --max-replicas (if given) at least --replicas; got %s and %s", args.replicas, args.max_replicas)
        return 2
    threads = ray_args.replica_threads or int(os.environ.get("DASLLAMA_THREADS") or 1)
    if threads < 1:
        log.error("--replica-threads must be at least 1, got %d", threads)
        return 2
    agent = [f for f, v in (("--tools", args.tools), ("--tools-runtime", args.tools_runtime), ("--mcp-servers-config", args.mcp_servers_config), ("--mcp-servers-json", args.mcp_servers_json), ("--ui-mcp-proxy", args.ui_mcp_proxy)) if v]
    if agent:
        log.error("%s: the agent tools run on one machine; serve them with python -m dasllama.serve (or dasllama-server), not behind Ray", ", ".join(agent))
        return 2
    problem = unknown_model(args)
    if problem:
        log.error("%s", problem)
        return 1
    try:
        import ray
        from ray import serve
    except ImportError:
        log.error("Ray Serve is not installed: pip install 'dasllama[ray]' (or 'ray[serve]')")
        return 1
    from .deployments import build

    # RAY_ADDRESS, else a cluster `ray start` left running on this machine, else a new local one.
    ray.init(logging_level=logging.WARNING, log_to_driver=args.log_level == "debug")
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build(server_argv, replicas=args.replicas, routing=args.routing, threads=threads, max_replicas=args.max_replicas, imbalance=args.imbalance)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except Exception as e:  # noqa: BLE001 - a deployment that fails names its cause; say it and exit non-zero
        log.error("could not deploy the engine replicas: %s", e)
        serve.delete(APP_NAME)
        return 1
    scaling = f"{args.replicas}-{args.max_replicas} replicas (autoscaled)" if args.max_replicas and args.max_replicas > args.replicas else f"{args.replicas} replica(s)"
    log.info("serving on http://%s:%d: %s, %d thread(s) each, %s routing", args.host, args.port, scaling, threads, args.routing)
    while not stop.wait(1.0):  # a timed wait, so the signal handlers get to run
        pass
    log.info("taking the application down")
    serve.delete(APP_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
