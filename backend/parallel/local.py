"""Run a function on N local processes forming one group: gloo on CPU, NCCL with one GPU per rank."""
from __future__ import annotations

import multiprocessing as mp
import queue
import secrets
import traceback
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist

from .group import join_group
from .ports import free_port

# What every rank imports anyway: the fork server imports it once, and each rank starts as a fork of it (about
# 5 s of imports a process saved on a 2-core machine). It touches no GPU and starts no thread pool.
PRELOAD = ["torch", "torch.distributed", "numpy", "diffusers", "transformers", "backend.engine.rollout"]


def process_context() -> mp.context.BaseContext:
    """Where local ranks start: forks of a fork server that has imported `PRELOAD` (not of the caller, whose
    threads and torch state a plain fork would copy)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(
    rank: int, ranks: int, port: int, secret: str, backend: str, fn: Callable, args: tuple, threads: int,
    results: mp.Queue,
) -> None:
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        groups = join_group(rank, ranks, "127.0.0.1", port, backend, init_timeout_s=600, collective_timeout_s=600,
                            secret=secret)
        results.put((rank, fn(groups, *args), None))
    except BaseException:  # report every failure to the parent instead of hanging it
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(
    ranks: int,
    fn: Callable[..., Any],
    args: tuple = (),
    timeout_s: float = 600,
    threads: int = 1,
    backend: str = "gloo",
) -> list:
    """fn(groups, *args) on every rank (fn must be importable; groups: parallel.group.GroupHandles, with a
    decode group); returns the per-rank results in rank order.

    With backend "nccl", rank r runs on cuda:r.
    """
    ctx = process_context()
    results: mp.Queue = ctx.Queue()
    port, secret = free_port(), secrets.token_hex(16)
    procs = [
        ctx.Process(target=_rank_main, args=(r, ranks, port, secret, backend, fn, args, threads, results))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(ranks):
            try:
                rank, value, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"run_group: no result from some rank within {timeout_s} s") from None
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(ranks)]
