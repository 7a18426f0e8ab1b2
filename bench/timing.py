"""Timing primitives: ``do_bench`` medians, CUDA-graph replays, a time budget, and a CPU stand-in.

Graph replay exists because a Python-launched decode step pays ~100-180 us of launch overhead
that hides a few-microsecond kernel: the op is captured several times inside one graph (rotating
input sets), the graph is replayed back to back and CUDA events around many replays give the
per-call time.
"""

import math
import statistics
import time

import torch


class Budget:
    """Wall-clock budget for the whole run, shared out between families as they start.

    A family gets ``share / (sum of shares still to run)`` of the time left, so time an early
    family does not use carries over to later ones.  Work past a family's deadline is recorded
    as skipped rows instead of running (the run must fit one device call).
    """

    def __init__(self, total_s: float, shares: dict[str, float]):
        self.start = time.monotonic()
        self.total_s = total_s
        self.pending = dict(shares)
        self.deadline = self.start + total_s

    def left(self) -> float:
        return self.start + self.total_s - time.monotonic()

    def begin(self, family: str) -> None:
        share = self.pending.pop(family, 0.0)
        pending_total = share + sum(self.pending.values())
        fraction = share / pending_total if pending_total > 0 else 1.0
        self.deadline = time.monotonic() + max(0.0, self.left()) * fraction

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


class Timer:
    """``launched``: median ms per call of Python-launched calls; ``graph``: per-call ms from graph replays.

    Each call to the returned functions rotates through ``fns`` (one closure per input set).
    """

    def __init__(self, device: torch.device, quick: bool):
        self.cuda = device.type == "cuda"
        self.quick = quick

    def launched(self, fns, slow: bool = False) -> float:
        state = {"i": 0}

        def step():
            fns[state["i"] % len(fns)]()
            state["i"] += 1

        if not self.cuda:
            return self._cpu(step)
        import triton.testing

        warmup, rep = (10, 30) if self.quick else (10, 60)  # ms; ~100+ samples for the µs-scale calls
        if slow:  # ~10-100 ms calls (PyTorch references on prefill): a few calls are enough
            warmup, rep = 1, 1
        return float(triton.testing.do_bench(step, warmup=warmup, rep=rep, return_mode="median"))

    @staticmethod
    def _cpu(step) -> float:
        # Interpreter: one timed call after the correctness call warmed things up. Not a measurement.
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    def graph(self, fns, min_calls: int = 32) -> float | None:
        """Per-call ms of ``fns`` captured round-robin in one CUDA graph: every set at least once, and
        up to ``min_calls`` calls when calls are short, so one replay lasts ~2 ms or more."""
        if not self.cuda:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):  # warm-up off the capture stream, as capture requires
            for f in fns:
                f()
            start.record()
            for f in fns:
                f()
            end.record()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # Enough calls per replay that a replay lasts >= ~2 ms (launch gaps amortised), at most min_calls.
        per_call = max(start.elapsed_time(end) / len(fns), 1e-4)
        rounds = max(1, math.ceil(min(min_calls, 2.0 / per_call) / len(fns)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for f in fns:
                    f()
        calls_per_replay = rounds * len(fns)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        one = max(start.elapsed_time(end), 1e-3)
        target_ms = 10.0 if self.quick else 25.0  # per timing window
        replays = max(3, min(2000, int(target_ms / one)))
        samples = []
        for _ in range(3 if self.quick else 5):
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / (replays * calls_per_replay))
        del graph
        return statistics.median(samples)
