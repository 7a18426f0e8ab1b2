"""The run context (device, timer, budget, ceilings) and ``Context.provider``: check, then time, then record.

A provider that raises (compile error, unsupported shape, graph capture failure) becomes an error
row and the run goes on.
"""

import dataclasses
import datetime
import platform as host_platform
import traceback

import torch

from bench.timing import Budget, Timer

COLUMNS = [
    "family",
    "shape",
    "provider",
    "mode",
    "graph_replay",
    "dtype",
    "kv_dtype",
    "ms",
    "us",
    "tflops",
    "gbps",
    "pct_of_ceiling",
    "ceiling_kind",
    "flops",
    "bytes",
    "topk_share",
    "correct",
    "max_err",
    "n_sets",
    "note",
    "error",
    "gpu",
    "torch",
    "triton",
    "python",
    "timestamp",
]


def environment(device: torch.device) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": host_platform.python_version(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@dataclasses.dataclass
class Check:
    ok: bool
    max_err: float | None = None
    note: str = ""


class Context:
    def __init__(self, device: torch.device, quick: bool, budget: Budget, share: int = 1):
        self.device = device
        self.cuda = device.type == "cuda"
        self.quick = quick
        self.timer = Timer(device, quick)
        self.budget = budget
        self.topk_share = share
        self.env = environment(device)
        self.rows: list[dict] = []
        self.ceilings: dict[str, float] = {}  # "copy" GB/s, "matmul" TFLOP/s
        # CPU mode checks the harness only: aot_eager traces the ops (fakes, launchers) without C++ builds.
        self.compile_backend = "inductor" if self.cuda else "aot_eager"
        self._compiled = {}
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
        else:
            self.l2_bytes = 1 << 20

    def compile(self, fn, **kw):
        """One compiled wrapper per (function, options) for the whole run, so families share its graphs."""
        key = (fn, tuple(sorted(kw.items())))
        if key not in self._compiled:
            self._compiled[key] = torch.compile(fn, backend=self.compile_backend, **kw)
        return self._compiled[key]

    def record(self, **fields) -> dict:
        row = {c: "" for c in COLUMNS}
        row.update(self.env)
        row.update({k: v for k, v in fields.items() if v is not None})
        self.rows.append(row)
        status = row["error"] or ("ok" if row["correct"] in (True, "") else "WRONG")
        timing = f"{row['ms']:.4f} ms" if isinstance(row["ms"], float) else "-"
        print(
            f"  {row['family']:8s} {row['shape']:26s} {row['kv_dtype']:5s} {row['provider']:24s} "
            f"{row['mode']:8s} {timing:>14s} {self._rate(row):>16s}  {status[:80]}",
            flush=True,
        )
        return row

    @staticmethod
    def _rate(row) -> str:
        if isinstance(row["pct_of_ceiling"], float):
            rate = f"{row['tflops']:.1f} TF/s" if row["ceiling_kind"] == "matmul" else f"{row['gbps']:.0f} GB/s"
            return f"{rate} {row['pct_of_ceiling']:.0f}%"
        return ""

    def provider(
        self,
        base: dict,
        provider: str,
        fns,
        check,
        modes=("launched",),
        flops=None,
        nbytes=None,
        ceiling_kind="copy",
        slow=False,
        note="",
    ):
        """Check ``fns[0]()`` with ``check`` (-> Check), then time every mode; one row per mode."""
        row = dict(base, provider=provider, flops=flops, bytes=nbytes, ceiling_kind=ceiling_kind, n_sets=len(fns))
        if not self.cuda:
            modes = tuple(m for m in modes if m != "graph")
        if self.budget.expired():
            for mode in modes:
                self.record(**row, mode=mode, graph_replay=mode == "graph", error="skipped: time budget")
            return
        try:
            verdict = check(fns[0]())
        except Exception as e:  # a broken provider is a row, not the end of the run
            self._failed(row, modes, e)
            return
        notes = "; ".join(n for n in (note, verdict.note) if n)
        for mode in modes:
            try:
                ms = self.timer.graph(fns) if mode == "graph" else self.timer.launched(fns, slow=slow)
            except Exception as e:
                self._failed(dict(row, correct=verdict.ok, max_err=verdict.max_err), (mode,), e)
                continue
            self.record(
                **row,
                mode=mode,
                graph_replay=mode == "graph",
                correct=verdict.ok,
                max_err=verdict.max_err,
                note=notes,
                **self.rates(ms, flops, nbytes, ceiling_kind),
            )

    def rates(self, ms: float, flops, nbytes, ceiling_kind: str) -> dict:
        out = {"ms": ms, "us": ms * 1e3}
        if flops:
            out["tflops"] = flops / ms / 1e9
        if nbytes:
            out["gbps"] = nbytes / ms / 1e6
        value = out.get("tflops") if ceiling_kind == "matmul" else out.get("gbps")
        if value is not None and self.ceilings.get(ceiling_kind):
            out["pct_of_ceiling"] = 100.0 * value / self.ceilings[ceiling_kind]
        return out

    def _failed(self, row, modes, e: Exception) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize()
            except Exception:  # a sticky CUDA error: later rows will say so themselves
                pass
        message = f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
        print("    " + traceback.format_exc().strip().splitlines()[-1][:300], flush=True)
        for mode in modes:
            self.record(**row, mode=mode, graph_replay=mode == "graph", error=message)
