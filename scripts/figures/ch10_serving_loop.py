"""Chapter 10's figure: the serving loop. The event loop answers HTTP, the engine thread steps the engine, and
the two meet in one place: a list of pending operations under a lock. Outputs go back to the event loop as
snapshots, and a client that leaves becomes an abort in that list.

The names in the boxes are those of `rosellm/async_engine.py` and `rosellm/api_server.py`.

    .venv/bin/python scripts/figures/ch10_serving_loop.py   ->  docs/figures/ch10_serving_loop.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "figures" / "ch10_serving_loop.png"

LOOP_COLOR, ENGINE_COLOR, QUEUE_COLOR = "#deebf7", "#fee6ce", "#efedf5"
ADD, ABORT, OUTPUT = "#3182bd", "#a50f15", "#31a354"


def box(ax, x, y, w, h, color, title=None, lines="", size=8.4, lw=1.1, title_size=9.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.08", facecolor=color, edgecolor="black", lw=lw))
    top = y + h - 0.2
    if title:
        ax.text(x + 0.2, top, title, fontsize=title_size, fontweight="bold", va="top")
        top -= 0.5
    if lines:
        ax.text(x + 0.2, top, lines, fontsize=size, va="top", linespacing=1.4)


def arrow(ax, start, end, color="black", text=None, where=None, rad=0.0, size=7.8, ha="center", **style):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle="-|>", mutation_scale=12, lw=1.4, color=color, connectionstyle=f"arc3,rad={rad}"
        )
    )
    if text:
        x, y = where if where else ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.25)
        ax.text(x, y, text, fontsize=size, color=color, ha=ha, va="center", **style)


def draw_clients(ax):
    ax.text(0.3, 13.35, "clients", fontsize=10, fontweight="bold")
    clients = [
        (10.6, "A: a streamed chat", "SSE chunks as tokens come"),
        (7.4, "B: a completion", "one JSON body at the end"),
        (4.2, "C: leaves early", "closes its connection"),
    ]
    for y, name, what in clients:
        box(ax, 0.3, y, 3.3, 1.6, "white", name, what, size=8)
    return {name[0]: y for y, name, _ in clients}


def draw_event_loop(ax, clients):
    box(ax, 4.6, 0.9, 7.0, 12.1, LOOP_COLOR, "event loop  (main thread: uvicorn + FastAPI)", title_size=10)
    box(
        ax,
        4.9,
        9.9,
        6.4,
        2.35,
        "white",
        "a route per request",
        "parse the body: OpenAI's fields → prompt, SamplingParams\n"
        "(a bad one: 400 at once; an unknown model: 404)\n"
        "await engine.add_request(...): the engine thread\n"
        "checks it (ValueError → 400), then a RequestStream",
        size=7.8,
    )
    box(
        ax,
        4.9,
        6.6,
        6.4,
        2.75,
        "white",
        "RequestStream  (one per request)",
        "holds the latest RequestOutput snapshot, not a queue:\n"
        "a new snapshot replaces one not yet taken; each holds\n"
        "all the text so far, so a slow reader misses nothing\n"
        "EventStreamResponse: the new characters of each\n"
        "answer as `data: {chunk}`, then `data: [DONE]`",
        size=7.8,
    )
    box(
        ax,
        4.9,
        3.7,
        6.4,
        2.35,
        "white",
        "when a client leaves",
        "uvicorn reports http.disconnect; Starlette cancels\n"
        "the streaming response (a whole answer: the route\n"
        "races its work against the disconnect and cancels it)\n"
        "finally: stream.abort() → an abort is queued",
        size=7.8,
    )
    box(
        ax,
        4.9,
        1.3,
        6.4,
        1.75,
        "white",
        "GET /metrics, /health",
        "read EngineMetrics under its own lock: the gauges\nthe engine thread recorded after its last step",
        size=7.8,
    )
    # Requests in (blue), answers out (green), a disconnect (red).
    a, b, c = clients["A"], clients["B"], clients["C"]
    arrow(ax, (3.65, a + 1.1), (4.85, a + 1.1), ADD, "POST", where=(4.25, a + 1.35))
    arrow(ax, (3.65, b + 1.1), (4.85, 10.15), ADD, "POST", where=(3.88, b + 1.95))
    arrow(ax, (4.85, 8.9), (3.65, a + 0.3), OUTPUT, "SSE", where=(4.45, a + 0.15))
    arrow(ax, (4.85, 7.0), (3.65, b + 0.4), OUTPUT, "JSON", where=(4.25, b - 0.05))
    arrow(ax, (3.65, c + 0.8), (4.85, c + 0.8), ABORT, "FIN", where=(4.25, c + 1.05))


def draw_queue(ax):
    box(ax, 12.1, 4.3, 2.5, 6.0, QUEUE_COLOR, "pending", title_size=9.5)
    ax.text(12.3, 9.6, "operations,\nin arrival order", fontsize=7.8, va="top")
    items = [("add  r7", ADD), ("abort  r3", ABORT), ("add  r8", ADD)]
    for i, (label, color) in enumerate(items):
        y = 8.1 - i * 0.9
        ax.add_patch(FancyBboxPatch((12.3, y), 2.1, 0.6, boxstyle="round,pad=0.04", facecolor="white", ec=color))
        ax.text(13.35, y + 0.3, label, fontsize=8, ha="center", va="center", color=color)
    ax.text(
        13.35,
        4.5,
        "one lock, a\nthreading.Condition:\n_submit appends\nand notifies",
        fontsize=7.2,
        ha="center",
        va="bottom",
    )
    arrow(ax, (11.35, 10.6), (12.2, 9.95), ADD, "add", where=(11.8, 10.6))
    arrow(ax, (11.35, 5.0), (12.2, 5.0), ABORT)


def draw_engine(ax):
    box(ax, 15.5, 0.9, 6.7, 12.1, ENGINE_COLOR, "engine thread  (rosellm-engine)", title_size=10)
    ax.text(15.7, 11.95, "the only thread that touches the LLMEngine", fontsize=7.8, style="italic", va="top")
    steps = [
        (1.15, "1  sleep on the condition while nothing is\n   pending and nothing runs (no polling)"),
        (0.75, "2  take the whole pending list, under the lock"),
        (
            1.55,
            "3  apply each operation, in order:\n   add → LLMEngine.add_request (settles\n"
            "   the caller's future); abort → abort_request:\n   its blocks are free at once",
        ),
        (
            1.55,
            "4  LLMEngine.step(): schedule, forward, sample,\n   detokenize, stop strings; if it raises,\n"
            "   once more; if again, only the requests it\n   scheduled end with StepFailedError",
        ),
        (
            1.2,
            "5  deliver each output to its caller's loop:\n   loop.call_soon_threadsafe(stream.put, out);\n"
            "   record TTFT, inter-token latency, gauges",
        ),
    ]
    top, gap, edges = 11.4, 0.45, []
    for h, text in steps:
        box(ax, 15.8, top - h, 5.6, h, "white", lines=text, size=7.8)
        edges.append((top, top - h))
        top -= h + gap
    for (_, bottom), (next_top, _) in zip(edges, edges[1:]):
        ax.annotate("", (18.6, next_top + 0.1), (18.6, bottom - 0.1), arrowprops=dict(arrowstyle="-|>", lw=1.1))
    # Back to the top: the loop.
    first, last = (edges[0][0] + edges[0][1]) / 2, (edges[-1][0] + edges[-1][1]) / 2
    ax.plot([21.5, 21.85, 21.85], [last, last, first], color="black", lw=1.1)
    ax.annotate("", (21.5, first), (21.85, first), arrowprops=dict(arrowstyle="-|>", lw=1.1))
    ax.text(22.02, (first + last) / 2, "the next iteration", fontsize=7.8, rotation=90, ha="center", va="center")
    # The pending list is taken at step 2; outputs go back to the streams from step 5.
    step2 = (edges[1][0] + edges[1][1]) / 2
    arrow(ax, (14.65, 9.0), (15.75, step2), "black", "taken\nbetween\nsteps", where=(15.05, 8.35), size=7.2)
    ax.plot([15.75, 11.85, 11.85], [last, last, 6.95], color=OUTPUT, lw=1.4)
    arrow(ax, (11.85, 6.95), (11.35, 6.95), OUTPUT)
    ax.text(13.75, last - 0.4, "snapshots", fontsize=7.8, color=OUTPUT, ha="center")
    ax.text(
        15.8,
        1.25,
        "PyTorch releases the GIL inside its kernels:\nwhile a forward runs here, the event loop\ngoes on serving HTTP",
        fontsize=7.8,
        va="bottom",
    )


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 7.4))
    clients = draw_clients(ax)
    draw_event_loop(ax, clients)
    draw_queue(ax)
    draw_engine(ax)
    ax.set_xlim(0, 22.5)
    ax.set_ylim(0.6, 13.8)
    ax.axis("off")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
