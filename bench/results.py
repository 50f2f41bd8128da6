"""The one header every ``bench/RESULTS*.md`` entry starts with: what ran, when, and on what.

Figures from a shared 2-core machine mean little without the date, the machine, the torch
build, the core count and the load at the time, so every bench prints them the same way:

    ## bench_zero — 2026-11-26 19:40 UTC, AMD EPYC 7B13 (x86_64), torch 2.13.0+cpu, 2 cores, load 1.3 0.9 0.7
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch


def machine() -> str:
    """The GPU's name where one is visible, else the CPU's model name (from /proc/cpuinfo) and architecture."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]} ({platform.machine()})" if names else platform.processor() or platform.machine()


def results_header(bench: str) -> str:
    """``## <bench> — date, machine, torch, cores, load`` (the 1, 5 and 15 minute load averages, now)."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"## {bench} — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, "
            f"torch {torch.__version__}, {os.cpu_count()} cores, load {load}")


def add_out_flag(parser: argparse.ArgumentParser) -> None:
    """``--out FILE``: where ``emit`` appends the table (every bench's RESULTS file is a log of runs)."""
    parser.add_argument("--out", default=None, help="append the table to this file")


def emit(text: str, out: str | None) -> None:
    """Print a bench's table and append it to ``out`` when given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n\n")
