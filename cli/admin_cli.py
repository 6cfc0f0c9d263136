"""``pdfabric admin``: the router's admin API from the command line (see docs/platform.md).

    pdfabric admin models                                   # versions, weights, rollouts
    pdfabric admin weights chat v1=90 v2=10                 # traffic weights
    pdfabric admin add-version chat v3 --model tiny-b --colocated 1 [--weight 0] [--set KEY=VALUE]
    pdfabric admin rollout chat v3 --steps 5,25,50,100 --step-s 60 [--max-error-rate 0.05 ...]
    pdfabric admin rollout-stop chat
    pdfabric admin remove-version chat v1
    pdfabric admin usage
    pdfabric admin drain WORKER_ID

The admin key comes from ``--admin-key`` or ``PDFABRIC_ADMIN_KEY``; the answer is printed as JSON,
and the exit code is 0 for a 2xx answer, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default %(default)s)")
    parser.add_argument("--admin-key", help="the admin key (default: $PDFABRIC_ADMIN_KEY)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("models", help="every model's versions, weights and rollout")
    w = sub.add_parser("weights", help="set traffic weights: MODEL VERSION=WEIGHT ...")
    w.add_argument("model")
    w.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    a = sub.add_parser("add-version", help="start a version's workers; it takes traffic once warm")
    a.add_argument("model")
    a.add_argument("version")
    a.add_argument("--model", dest="checkpoint", required=True, help="preset or model directory")
    a.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    a.add_argument("--weight", type=float, default=0.0, help="its traffic weight once ready (default 0)")
    for kind in ("prefill", "decode", "colocated"):
        a.add_argument(f"--{kind}", type=int, default=0, help=f"{kind} workers")
    a.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a [worker] setting (JSON value)"
    )
    r = sub.add_parser("rollout", help="ramp a canary version up, rolled back if a guardrail trips")
    r.add_argument("model")
    r.add_argument("canary")
    r.add_argument(
        "--steps", default="5,25,50,100", help="the canary's percent per step (default %(default)s)"
    )
    r.add_argument("--step-s", type=float, default=60.0, help="least seconds per step (default %(default)s)")
    for name in ("max_error_rate", "max_ttft_ratio", "max_itl_ratio", "max_cost_ratio"):
        r.add_argument("--" + name.replace("_", "-"), type=float, help="guardrail (see docs/platform.md)")
    r.add_argument("--min-requests", type=int, help="canary requests per step before it is judged")
    s = sub.add_parser("rollout-stop", help="stop a rollout; the incumbents get their weights back")
    s.add_argument("model")
    d = sub.add_parser("remove-version", help="take a version out of service; its workers drain")
    d.add_argument("model")
    d.add_argument("version")
    sub.add_parser("usage", help="every tenant's usage per model")
    dr = sub.add_parser("drain", help="drain one worker")
    dr.add_argument("worker_id")


def request(args: argparse.Namespace) -> tuple[str, str, Any]:
    """(method, path, JSON body or None) for the command."""
    a = args.action
    if a == "models":
        return "GET", "/admin/models", None
    if a == "usage":
        return "GET", "/admin/usage", None
    if a == "drain":
        return "POST", f"/admin/workers/{args.worker_id}/drain", {}
    if a == "weights":
        weights = {}
        for item in args.weights:
            name, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"expected VERSION=WEIGHT, got {item!r}")
            weights[name] = float(value)
        return "POST", f"/admin/models/{args.model}/weights", {"weights": weights}
    if a == "add-version":
        body: dict[str, Any] = {"name": args.version, "model": args.checkpoint, "weight": args.weight}
        body |= {k: getattr(args, k) for k in ("prefill", "decode", "colocated") if getattr(args, k)}
        if args.dtype:
            body["dtype"] = args.dtype
        for item in args.set:
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"expected KEY=VALUE, got {item!r}")
            body[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
        return "POST", f"/admin/models/{args.model}/versions", body
    if a == "rollout":
        guard = {
            k: getattr(args, k)
            for k in ("max_error_rate", "max_ttft_ratio", "max_itl_ratio", "max_cost_ratio", "min_requests")
        }
        spec = {
            "canary": args.canary,
            "steps": [float(x) for x in args.steps.split(",")],
            "step_s": args.step_s,
            "guardrails": {k: v for k, v in guard.items() if v is not None},
        }
        return "POST", f"/admin/models/{args.model}/rollout", spec
    if a == "rollout-stop":
        return "DELETE", f"/admin/models/{args.model}/rollout", None
    return "DELETE", f"/admin/models/{args.model}/versions/{args.version}", None  # remove-version


def run(args: argparse.Namespace) -> int:
    try:
        method, path, body = request(args)
    except ValueError as exc:
        print(f"pdfabric admin: error: {exc}", file=sys.stderr)
        return 2
    key = args.admin_key or os.environ.get("PDFABRIC_ADMIN_KEY", "")
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.url.rstrip("/") + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    except OSError as exc:
        print(f"pdfabric admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(json.loads(text), indent=2))
    except ValueError:
        print(text.decode(errors="replace"))
    return 0 if 200 <= status < 300 else 1
