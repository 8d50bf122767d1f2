"""`bench serve --plot`: latency CDFs (TTFT, ITL, end-to-end) and TTFT over the run, one line
per target."""

from __future__ import annotations

from halfmoon.bench.metrics import RequestResult, latency_samples


def plot_runs(runs: list[tuple[str, list[RequestResult]]], path: str) -> None:
    """Write a 2x2 PNG: three CDFs in milliseconds and TTFT against send time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("ttft", "TTFT"), ("itl", "inter-token latency"), ("e2el", "end-to-end latency"))
    for (name, title), ax in zip(panels, axes.flat, strict=False):
        for label, results in runs:
            values = sorted(s * 1000 for s in latency_samples(results)[name])
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    over_time = axes.flat[3]
    for label, results in runs:
        served = [r for r in results if r.ok]
        over_time.plot(
            [r.sent_s for r in served], [r.ttft_s * 1000 for r in served], ".", label=label
        )
    over_time.set(title="TTFT over the run", xlabel="send time (s)", ylabel="TTFT (ms)")
    over_time.grid(alpha=0.3)
    for ax in axes.flat:
        ax.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
