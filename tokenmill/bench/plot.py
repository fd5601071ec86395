"""The latency-throughput curve of one or more `bench serve --sweep-rates` runs."""

from __future__ import annotations


def plot_sweeps(sweeps: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in ((axes[0], "ttft", "Time to first token"), (axes[1], "itl", "Inter-token latency")):
        for sweep in sweeps:
            runs = sorted(sweep["runs"], key=lambda r: r["output_throughput"])
            x = [r["output_throughput"] for r in runs]
            for pct, style in (("median", "-o"), ("p99", "--s")):
                y = [r.get(f"{pct}_{metric}_ms", float("nan")) for r in runs]
                ax.plot(x, y, style, label=f"{sweep['label']} {'p50' if pct == 'median' else pct}")
            for r, xi in zip(runs, x):
                ax.annotate(r["request_rate"], (xi, r.get(f"median_{metric}_ms", 0)), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_title(title)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency against throughput (labels: request rate, req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(timeline: dict, path: str, label: str) -> None:
    """A --rate-schedule run: each request's TTFT and latency at the time it started (failed ones marked), and
    under it the router's replicas (current, desired, in rotation) and held requests over the same time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.4), sharex=True)
    reqs = timeline["requests"]
    ok = [r for r in reqs if r[3]]
    top.plot([r[0] for r in ok], [1000 * r[2] for r in ok], ".", ms=4, label="end-to-end latency")
    top.plot([r[0] for r in ok], [1000 * r[1] for r in ok], ".", ms=4, label="TTFT")
    failed = [r for r in reqs if not r[3]]
    if failed:
        top.plot([r[0] for r in failed], [1.0] * len(failed), "rx", label=f"failed ({len(failed)})")
    top.set_yscale("log")
    top.set_ylabel("ms (at the request's start)")
    top.set_title(f"{label}: {len(reqs)} requests, {len(failed)} failed")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    fleet = timeline["fleet"]
    if fleet:
        t = [s[0] for s in fleet]
        for i, name, style in ((1, "current replicas", "-"), (2, "desired", "--"), (4, "in rotation", ":"),
                               (3, "held requests", "-.")):
            bottom.step(t, [s[i] for s in fleet], style, where="post", label=name)
    arrivals = sorted(r[0] for r in reqs)
    if arrivals:
        edges = list(range(0, int(max(arrivals)) + 6, 5))
        counts = [sum(1 for a in arrivals if lo <= a < lo + 5) / 5 for lo in edges]
        bottom.step(edges, counts, where="post", color="grey", alpha=0.5, label="arrivals / s (5 s bins)")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("count")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
