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
