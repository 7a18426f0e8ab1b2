"""Session 39 (prepared, not run): is one program's 64 KB page read (~3 us at B1, ~25-30 GB/s per SM) bound by where
the page lies in HBM?  Each program reads 64 KB as 128 rows of 512 bytes (a K/V page's token rows), taken as chunks
of CHUNK contiguous bytes from random pages of a 4 GiB pool: CHUNK = 64 KB is one page (the op's read), smaller
chunks spread the same bytes over more pages.  16 / 64 / 128 programs (TP8 B1 / TP1 B1 / a full wave), PDL
launches, graph replay over sets of fresh random pages (bench/attn_probe.replay_us).  If small chunks read faster,
a page's lines sit in few HBM channels and the op's one-page-per-program read is channel-bound.
Run: python3 .gpu/channel_floor.py"""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from bench import attn_probe as P

ROW_BYTES = 512  # one token's K and V at D = 128, bf16
ROWS = 128
PAGE_BYTES = ROW_BYTES * ROWS


@triton.jit
def _chunk_read_kernel(rows_ptr, pool_ptr, out_ptr, ROWS: tl.constexpr, ROW: tl.constexpr):
    """Program p: its ROWS row addresses (element offsets into the pool) read as one [ROWS, ROW] tile, summed."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    starts = tl.load(rows_ptr + pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    tile = tl.load(pool_ptr + starts[:, None] + tl.arange(0, ROW)[None, :])
    tl.store(out_ptr + pid, tl.sum(tl.sum(tile.to(tl.float32), axis=1), axis=0))


def row_starts(programs, chunk, pool_pages, gen):
    """[programs, ROWS] int64 element offsets: chunks of `chunk` bytes from random pages (aligned to the chunk)."""
    rows_per_chunk = chunk // ROW_BYTES
    chunks = ROWS // rows_per_chunk
    pages = torch.randint(0, pool_pages, (programs, chunks), generator=gen)
    slot = torch.randint(0, PAGE_BYTES // chunk, (programs, chunks), generator=gen)  # which chunk of that page
    base = pages * PAGE_BYTES + slot * chunk  # bytes
    rows = base[:, :, None] + torch.arange(rows_per_chunk)[None, None, :] * ROW_BYTES
    return (rows.reshape(programs, ROWS) // 2).to(torch.int32)  # bf16 elements


def main():
    copy = P.copy_gbps()
    print(torch.cuda.get_device_name(), f"copy {copy:.0f} GB/s", flush=True)
    pool = torch.zeros(1 << 31, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    pool_pages = pool.numel() * 2 // PAGE_BYTES
    gen = torch.Generator().manual_seed(0)
    for programs in (16, 64, 128):
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        line = f"{programs} programs x 64 KB:"
        for chunk in (65536, 16384, 4096, 1024, 512):
            sets = [row_starts(programs, chunk, pool_pages, gen).cuda() for _ in range(64)]

            def call(rows):
                _chunk_read_kernel[(programs,)](rows, pool, out, ROWS=ROWS, ROW=ROW_BYTES // 2, num_warps=8,
                                                launch_pdl=True)
                return out

            us, _ = P.replay_us(call, sets)
            line += f"  chunk {chunk // 1024 if chunk >= 1024 else chunk / 1024:g} KB {us:.2f} us"
        print(line, flush=True)


if __name__ == "__main__":
    main()
