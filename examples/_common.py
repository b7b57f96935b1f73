"""Shared by the examples: a backend from the command line (default: plait's runtime in-process)."""

import argparse

import plait as pl


def backend_from_args(description: str) -> pl.Backend:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--url", help="a running plait or SGLang server (default: start plait's runtime here)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.url:
        return pl.RuntimeEndpoint(args.url)
    return pl.Runtime(num_threads=args.threads, log_level="warning")
