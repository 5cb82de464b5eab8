"""The staged KV path on a real device, with torch and kvray's staging code only (no vLLM,
Ray or Mooncake: what a bare GPU machine has).

1. Byte-exact round trips: synthetic KV caches in the device layouts vLLM's attention
   backends use are gathered into a real shared staging region (pinned with
   cudaHostRegister on CUDA) and scattered back; the staged bytes must equal each block's
   logical bytes and the cache must come back identical; then the same layer group by
   layer group without waiting (``use_layerwise``: copies on the side stream, events).
2. Bandwidth: device-to-host (save) and host-to-device (load) GB/s of the staging path
   for a model-sized step, next to torch's own pinned ``copy_`` of the same number of
   bytes (one contiguous tensor: the ceiling), reps interleaved, every rep recorded.

    python scripts/device_check.py [--device cuda] [--out bench-results/device_check.json]
    python scripts/device_check.py --smoke --out /tmp/device_check.json   # seconds

Runs on CPU too (``--device cpu``; that is how CI keeps it working). Exit status 1 when
any round trip is not byte-exact.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from _common import parse  # noqa: E402

SMOKE = ["--reps", "2", "--layers", "4", "--step-blocks", "8"]
"""``--smoke``: every layout's round trips as in the full run, a small bandwidth step."""

Entry = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""One layer's KV cache: one tensor, or vLLM-Ascend's (k_cache, v_cache)."""
Maker = Callable[[], Entry]


def _load_staging() -> types.ModuleType:
    """kvray's staging modules without kvray's package imports (which pull in Ray,
    pydantic and vLLM): the packages are registered empty, the modules loaded from
    their files."""
    for pkg, path in (("kvray", ROOT / "kvray"), ("kvray.connector", ROOT / "kvray/connector")):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(path)]
            sys.modules[pkg] = mod
    for name in ("kvray.errors", "kvray.shm", "kvray.connector.kv_geometry",
                 "kvray.connector.staging"):  # fmt: skip
        if name in sys.modules:
            continue
        rel = name.replace(".", "/") + ".py"
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["kvray.connector.staging"]


def _permuted(
    logical: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    phys = torch.randn(tuple(logical[i] for i in order), device=device).to(dtype)
    return phys.permute(*(order.index(i) for i in range(len(order))))


def layouts(
    nb: int, bs: int, h: int, d: int, dtype: torch.dtype, device: torch.device
) -> dict[str, tuple[Maker, int]]:
    """name -> (one layer's entry builder, the block dimension of each plane)."""
    return {
        # vLLM 0.32 unified logical view [B, H, N, C] over its default memory order
        "vllm032 [B,H,N,C]": (lambda: torch.randn(nb, h, bs, 2 * d, device=device).to(dtype), 0),
        # the same logical view over an NHD memory order ([B, N, H, C])
        "vllm032 over [B,N,H,C]": (
            lambda: _permuted((nb, h, bs, 2 * d), (0, 2, 1, 3), dtype, device), 0),
        # FlashAttention before 0.32: K and V planes outside the block dimension
        "flash (2,B,N,H,D)": (lambda: torch.randn(2, nb, bs, h, d, device=device).to(dtype), 1),
        # vLLM-Ascend style: a (k_cache, v_cache) tuple per layer
        "tuple (k,v) (B,N,H,D)": (
            lambda: (torch.randn(nb, bs, h, d, device=device).to(dtype),
                     torch.randn(nb, bs, h, d, device=device).to(dtype)), 0),
        # MLA: one latent cache
        "mla (B,N,D)": (lambda: torch.randn(nb, bs, 576, device=device).to(dtype), 0),
    }  # fmt: skip


def _planes(entry: Entry) -> list[torch.Tensor]:
    return [entry] if isinstance(entry, torch.Tensor) else list(entry)


def check_layout(
    staging: Any, name: str, make: Maker, bdim: int, nb: int, device: torch.device
) -> dict[str, Any]:
    caches = {f"layer.{i}": make() for i in range(4)}
    before = {n: [p.clone() for p in _planes(e)] for n, e in caches.items()}
    stager = staging.Stager(caches, nb, None, "kvray-devcheck", default_slots=16)
    try:
        blocks = [5, 0, nb - 1, 17, 3]
        first = stager.reserve(len(blocks))
        stager.gather(blocks, first)
        offsets, lengths = stager.offsets(first, len(blocks))
        buf = stager.region.array
        staged_ok = True
        for i, b in enumerate(blocks):
            segs = zip(offsets[i], lengths[i], strict=True)
            got = b"".join(buf[o : o + n].tobytes() for o, n in segs)
            want = b"".join(
                p.select(bdim, b).contiguous().cpu().view(torch.uint8).numpy().tobytes()
                for e in caches.values() for p in _planes(e)
            )  # fmt: skip
            staged_ok &= got == want
        for e in caches.values():
            for p in _planes(e):
                p.index_fill_(bdim, torch.tensor(blocks, device=device), 0)
        stager.scatter(blocks, first, range(len(blocks)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        restored = _restored(caches, before)
        layerwise = _layerwise_round_trip(stager, caches, before, blocks, first, bdim, device)
        return {"layout": name, "pinned": stager.pinned, "staged_bytes_exact": staged_ok,
                "restored_exact": restored, "layerwise_exact": layerwise,
                "geometry": str(stager.geometry)}  # fmt: skip
    finally:
        stager.close()


def _restored(caches: dict[str, Entry], before: dict[str, list[torch.Tensor]]) -> bool:
    return all(
        torch.equal(p.view(torch.uint8), o.view(torch.uint8))
        for n, e in caches.items() for p, o in zip(_planes(e), before[n], strict=True)
    )  # fmt: skip


def _layerwise_round_trip(
    stager: Any,
    caches: dict[str, Entry],
    before: dict[str, list[torch.Tensor]],
    blocks: list[int],
    first: int,
    bdim: int,
    device: torch.device,
) -> bool:
    """``use_layerwise``: two layer groups gathered into fresh slots without waiting
    (events; the put would be sent once each completed), then scattered back group by
    group without waiting (the compute stream waits on each): the same bytes as the
    whole-step gather, the cache restored exactly."""
    n = len(blocks)
    second = stager.reserve(n)
    half = stager.columns // 2 // stager.planes_per_layer * stager.planes_per_layer
    groups = [(0, half), (half, stager.columns)]
    events = [stager.gather(blocks, second, g, wait=False) for g in groups]
    for ev in events:
        if ev is not None:
            ev.synchronize()
    off1, len1 = stager.offsets(first, n)
    off2, _ = stager.offsets(second, n)
    buf = stager.region.array
    same = all(
        buf[a : a + m].tobytes() == buf[b : b + m].tobytes()
        for a, b, m in zip(off1.ravel(), off2.ravel(), len1.ravel(), strict=True)
    )
    for e in caches.values():
        for p in _planes(e):
            p.index_fill_(bdim, torch.tensor(blocks, device=device), 0)
    mark = stager.ops.compute_mark()
    last = None
    for g in groups:
        last = stager.scatter(blocks, second, range(n), g, after=last or mark, wait=False)
    _sync(device)
    stager.release(second, n)
    return same and _restored(caches, before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bandwidth(
    staging: Any, device: torch.device, reps: int, layers: int, nb: int, step_blocks: int
) -> dict[str, Any]:
    """One model-sized step: ``step_blocks`` blocks of ``layers`` layers (vLLM 0.32
    layout, bf16, 8 KV heads x 128, block 16)."""
    bs, h, d = 16, 8, 128
    caches = {f"layer.{i}": torch.randn(nb, h, bs, 2 * d, device=device).to(torch.bfloat16)
              for i in range(layers)}  # fmt: skip
    stager = staging.Stager(caches, nb, None, "kvray-devbw", default_slots=step_blocks)
    pinned = stager.pinned
    total = stager.block_bytes * step_blocks
    blocks = list(range(0, 2 * step_blocks, 2))  # every other block: a real gather
    dev_flat = torch.empty(total, dtype=torch.uint8, device=device)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rows: list[dict[str, Any]] = []
    try:
        first = stager.reserve(step_blocks)
        for rep in range(reps):
            for what in ("staged_d2h", "torch_d2h", "staged_h2d", "torch_h2d"):
                _sync(device)
                t0 = time.perf_counter()
                if what == "staged_d2h":
                    stager.gather(blocks, first)
                elif what == "staged_h2d":
                    stager.scatter(blocks, first, range(step_blocks))
                elif what == "torch_d2h":
                    host.copy_(dev_flat, non_blocking=True)
                else:
                    dev_flat.copy_(host, non_blocking=True)
                _sync(device)
                dt = time.perf_counter() - t0
                rows.append({"rep": rep, "path": what, "seconds": dt, "gbps": total / dt / 1e9})
        stager.release(first, step_blocks)
    finally:
        stager.close()
    med = {p: statistics.median(r["gbps"] for r in rows if r["path"] == p)
           for p in ("staged_d2h", "torch_d2h", "staged_h2d", "torch_h2d")}  # fmt: skip
    return {"bytes_per_step": total, "layers": layers, "step_blocks": step_blocks,
            "pinned": pinned, "median_gbps": med, "reps": rows}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--step-blocks", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "device_check.json"))
    args = parse(ap, SMOKE)
    device = torch.device(args.device)
    staging = _load_staging()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"device_check: {device} ({name}), torch {torch.__version__}", flush=True)
    results = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for lname, (make, bdim) in layouts(64, 16, 4, 64, dtype, device).items():
            r = check_layout(staging, lname, make, bdim, 64, device)
            r["dtype"] = str(dtype).removeprefix("torch.")
            results.append(r)
            ok = r["staged_bytes_exact"] and r["restored_exact"] and r["layerwise_exact"]
            print(f"  {'ok  ' if ok else 'FAIL'} {r['dtype']:9} {lname:26} pinned={r['pinned']}",
                  flush=True)  # fmt: skip
    print(f"bandwidth: {args.layers} layers x {args.step_blocks} blocks, {args.reps} reps "
          "(interleaved)", flush=True)  # fmt: skip
    bw = bandwidth(staging, device, args.reps, args.layers, 4 * args.step_blocks, args.step_blocks)
    print(f"  {'path':12} {'median GB/s':>12}")
    for p, v in bw["median_gbps"].items():
        print(f"  {p:12} {v:12.2f}")
    out = {"device": str(device), "device_name": name, "torch": torch.__version__,
           "round_trips": results, "bandwidth": bw}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    bad = [
        r
        for r in results
        if not (r["staged_bytes_exact"] and r["restored_exact"] and r["layerwise_exact"])
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
