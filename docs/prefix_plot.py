"""The plot of the prefix-caching study (docs/prefix_study.py --plot): part 1's hit rates and
part 2's two orders, side by side, in docs/prefix_study.png. It needs matplotlib, which nanoinfer
does not depend on: without it the plot is skipped, with a note."""
from collections import defaultdict

# Hashed blocks dark and light blue, the radix tree dark and light orange.
COLORS = ["#1f77b4", "#9ecae1", "#e6550d", "#fdae6b"]


def plot(rows1: list, rows2: list, path: str) -> None:
    """Bars per stream: the replay's served tokens (`rows1`, prefix_study's `Part1Row`s), and
    admission's served tokens and longest wait (`rows2`, its `Part2Row`s)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = list(dict.fromkeys(row.stream for row in rows1))
    bars = defaultdict(list)   # a series of bars (one per stream) by its label
    for row in rows1:
        r = row.replay
        bars[f"{row.cache}, {row.capacity}"].append(100 * sum(r.hits) / r.prompt_tokens)
    for row in rows2:
        for order, result in (("FCFS", row.fcfs), ("cache-aware", row.cache_aware)):
            bars[f"{row.cache}, {order}"].append(100 * result.hit_rate)
            bars[f"{row.cache}, {order}, wait"].append(result.longest_wait)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [(axes[0], "replay: prompt tokens served from the cache (%)", ("ample", "tight")),
              (axes[1], "admission, tight: prompt tokens served (%)", ("FCFS", "cache-aware")),
              (axes[2], "admission, tight: longest wait (steps)", ("wait",))]
    for ax, title, ends in panels:
        keys = sorted((k for k in bars if k.endswith(ends)), key=lambda k: k.split(",")[0])
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(names))], bars[key], width,
                   label=key.removesuffix(", wait"), color=COLORS[j])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20)
        ax.set_title(title, fontsize=10)
        # (below the panel, where it covers no bar)
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
