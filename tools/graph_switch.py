"""How long the first launch of a CUDA graph takes after other graphs ran, against the number
of graphs in rotation (thirtieth session: on an H100, nine or more full-depth decode-step graphs
in one process, launched in turn, made each arm's first replay ~70 ms slower; eight did not).

    python tools/graph_switch.py --nodes 1500 --graphs 4,8,9,12,16 --rounds 20

Each graph is a chain of --nodes launches of one tiny kernel (captured on a stream with CuPy);
the rounds launch graph 0, 1, ..., G-1 in turn, each alone (synchronised), timed on the host.
It prints, per G, the median launch-to-done time of a graph in rotation and of the same graph
launched twice in a row (the warm case).  No memra_dsv4 import: the effect, if any, is the
driver's."""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1500)
    ap.add_argument("--graphs", default="4,8,9,12,16")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        counts = [int(x) for x in a.graphs.split(",")]
    except ValueError:
        raise SystemExit(f"--graphs {a.graphs!r}: expected comma-separated counts, e.g. 4,8,9") from None
    if min(counts) < 1:
        raise SystemExit(f"--graphs {a.graphs}: every count must be >= 1")
    if a.nodes < 1:
        raise SystemExit(f"--nodes {a.nodes}: expected >= 1")
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: expected >= 1 timed rounds")
    import cupy as cp
    k = cp.RawKernel(r'''extern "C" __global__ void bump(int* p) { if (threadIdx.x == 0) p[blockIdx.x] += 1; }''', "bump")
    buf = cp.zeros(64, cp.int32)
    s = cp.cuda.Stream(non_blocking=True)

    def make():
        with s:
            s.begin_capture()
            for _ in range(a.nodes):
                k((8,), (32,), (buf,))
            g = s.end_capture()
        g.upload(s)
        s.synchronize()
        return g

    graphs = [make() for _ in range(max(counts))]

    def timed(g):
        t0 = time.perf_counter()
        g.launch(s)
        s.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for G in counts:
        rot, warm = [], []
        for r in range(a.rounds + 1):   # round 0 untimed: every graph launched once
            for i in range(G):
                t = timed(graphs[i])
                if r:
                    rot.append(t)
                    warm.append(timed(graphs[i]))
        print(f"graphs {G:3d} x {a.nodes} nodes: first launch in rotation {statistics.median(rot):8.3f} ms, "
              f"again right after {statistics.median(warm):8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
