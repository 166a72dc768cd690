"""Time and peak memory of ``verify --per-node`` against a plain verify, each in a fresh process.

    python scripts/bench_per_node.py ORIGINAL.onnx CANDIDATE.onnx [--chunk-size 64] [-n 3]

Prints, per mode, the wall time and the process's peak RSS (``ru_maxrss``), then the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, sys, time
from optfuse.verify import verify
from optfuse.verify.per_node import compare_per_node
orig, cand, mode, chunk, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t = time.perf_counter()
if mode == "plain":
    verify(orig, cand, iterations=n)
    extra = {}
else:
    r = compare_per_node(orig, cand, iterations=n, chunk_size=chunk)
    extra = {"tensors": len(r.tensors), "chunks": r.chunks, "fused_nodes": len(r.fused)}
wall = time.perf_counter() - t
print(json.dumps(dict(mode=mode, wall_s=wall, peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      **extra)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("candidate")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("-n", "--iterations", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for mode in ("plain", "per-node"):
        out = subprocess.run([sys.executable, "-c", _CHILD, a.original, a.candidate, mode, str(a.chunk_size),
                              str(a.iterations)], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    print(f"per-node / plain: time {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}x, "
          f"peak RSS {rows[1]['peak_rss_mib']:.0f} MiB vs {rows[0]['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
