"""Pictures of a run: `python -m mpifsdp pictures RUN.jsonl [--out DIR]` draws the lines StepMetrics
wrote as PNGs, with matplotlib (the optional `viz` extra; nothing else in mpifsdp needs it).

    loss.png        train loss (and val loss, from note() lines) against step and against wall time
    throughput.png  tokens/s per step, and each step's time split into compute and exposed communication
    memory.png      one step's memory on every rank over time, by ledger category, with the process's RSS
                    (which holds what the ledger does not: activations, the interpreter, MPI)
    comm.png        bytes each unit moved in that step, by phase (forward gathers, backward gathers and
                    reduce-scatters, optimizer checks)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIB = 2**20


DRAWN = ("step", "time_s", "loss", "val_loss", "tokens_per_s", "compute_s", "exposed_comm_s")  # numbers


def read_run(path) -> dict:
    """The run's lines by kind: "steps" (StepMetrics.write), "notes" (note), "timeline" (or None).

    Every value a picture draws is checked here, so a file that is not a run is refused with the line
    and the reason instead of a traceback or a silently categorical axis."""
    run: dict = {"steps": [], "notes": [], "timeline": None}
    try:
        content = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not a text file ({exc.reason}); is this a StepMetrics file?") from exc
    lines = content.splitlines()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not content.endswith("\n"):
                continue  # a torn last line: a crash while it was written (a resume cuts it)
            raise ValueError(f"{where}: not a JSON line ({exc.msg}); is this a StepMetrics file?") from exc
        if not isinstance(line, dict):
            raise ValueError(
                f"{where}: a JSON {type(line).__name__}, not an object; is this a StepMetrics file?"
            )
        _require_numbers(where, line)
        if "timeline_step" in line:
            run["timeline"] = _checked_timeline(where, line)
        elif "tokens_per_s" in line:
            run["steps"].append(line)
        else:
            run["notes"].append(line)
    if not run["steps"]:
        raise ValueError(f"{path} holds no step lines: write it with mpifsdp.StepMetrics")
    return run


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_numbers(where: str, line: dict, keys=DRAWN):
    wrong = [f"{k}={line[k]!r}" for k in keys if line.get(k) is not None and not _is_number(line[k])]
    if wrong:
        raise ValueError(f"{where}: {', '.join(wrong)} where a number (or null) belongs")


def _is_event(event) -> bool:
    """[seconds, category, bytes, rss or null]: one entry of a rank's memory timeline."""
    if not (isinstance(event, list) and len(event) == 4):
        return False
    t, category, nbytes, rss = event
    return (
        _is_number(t)
        and isinstance(category, str)
        and _is_number(nbytes)
        and (rss is None or _is_number(rss))
    )


def _checked_timeline(where: str, line: dict) -> dict:
    """The timeline line: memory_events, one list per rank of [t, category, bytes, rss or null];
    bytes_by_unit_phase, {unit: {phase: bytes}}."""
    ranks, by_unit = line.get("memory_events"), line.get("bytes_by_unit_phase")
    events_ok = isinstance(ranks, list) and all(
        isinstance(events, list) and all(map(_is_event, events)) for events in ranks
    )
    bytes_ok = isinstance(by_unit, dict) and all(
        isinstance(phases, dict) and all(_is_number(b) for b in phases.values())
        for phases in by_unit.values()
    )
    if not (events_ok and bytes_ok and _is_number(line["timeline_step"])):
        raise ValueError(
            f"{where}: a timeline line needs timeline_step (a number), memory_events (per rank, a list of "
            "[seconds, category, bytes, rss]) and bytes_by_unit_phase ({unit: {phase: bytes}})"
        )
    return line


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("mpifsdp pictures draws with matplotlib: pip install 'mpifsdp[viz]'") from exc
    matplotlib.use("Agg")  # files only: no display needed (clusters, CI)
    import matplotlib.pyplot as plt

    return plt


def _series(lines, x: str, y: str):
    pairs = [(line[x], line[y]) for line in lines if line.get(x) is not None and line.get(y) is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def draw_loss(plt, run, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in zip(axes, ("step", "time_s"), ("step", "wall time (s)")):
        ax.plot(*_series(run["steps"], x, "loss"), label="train loss")
        xs, ys = _series(run["notes"], x, "val_loss")
        if xs:
            ax.plot(xs, ys, "o-", label="val loss")
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.legend()
    return _save(fig, out / "loss.png")


def draw_throughput(plt, run, out: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(*_series(run["steps"], "step", "tokens_per_s"))
    top.set_ylabel("tokens/s")
    steps, compute = _series(run["steps"], "step", "compute_s")
    _, exposed = _series(run["steps"], "step", "exposed_comm_s")
    bottom.stackplot(steps, compute, exposed, labels=["compute", "exposed communication"])
    bottom.set_xlabel("step")
    bottom.set_ylabel("seconds")
    bottom.legend(loc="upper right")
    return _save(fig, out / "throughput.png")


def draw_memory(plt, timeline, out: Path) -> Path:
    ranks = timeline["memory_events"]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(10, 2.6 * len(ranks)), sharex=True, squeeze=False)
    for rank, (ax, events) in enumerate(zip(axes[:, 0], ranks)):
        if not events:
            ax.set_ylabel(f"rank {rank}: no events")
            continue
        end = max(t for t, *_ in events)
        for category in dict.fromkeys(category for _, category, _, _ in events):
            points = [(t, b / MIB) for t, c, b, _ in events if c == category]
            points.append((end, points[-1][1]))  # each line runs to the step's end
            ax.step(*zip(*points), where="post", label=category)
        ax.set_ylabel(f"rank {rank}: ledger MiB")
        ax.legend(fontsize="small", loc="upper left")
        rss = [(t, r / MIB) for t, _, _, r in events if r is not None]
        if rss:  # its own axis: the interpreter and MPI alone can dwarf a small model's ledger
            twin = ax.twinx()
            twin.plot(*zip(*rss), "k:", label="process RSS")
            twin.set_ylabel("RSS MiB")
            twin.legend(fontsize="small", loc="upper right")
    axes[-1, 0].set_xlabel(f"seconds into step {timeline['timeline_step']}")
    return _save(fig, out / "memory.png")


def draw_comm(plt, timeline, out: Path) -> Path:
    by_unit = {
        unit or "(no unit: checks)": phases for unit, phases in timeline["bytes_by_unit_phase"].items()
    }
    units = sorted(by_unit)
    phases = sorted({phase for phases in by_unit.values() for phase in phases})
    fig, ax = plt.subplots(figsize=(9, 1 + 0.35 * max(1, len(units))))
    left = [0.0] * len(units)
    for phase in phases:
        widths = [by_unit[u].get(phase, 0) / MIB for u in units]
        ax.barh(units, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel(f"MiB moved by rank 0 in step {timeline['timeline_step']}")
    if phases:
        ax.legend(fontsize="small")
    return _save(fig, out / "comm.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    return path


def draw(run_path, out=None) -> list[Path]:
    """Every picture of the run; the PNGs go to `out` (default: next to the file). Returns their paths."""
    run = read_run(run_path)
    out = Path(out) if out else Path(run_path).parent
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    paths = [draw_loss(plt, run, out), draw_throughput(plt, run, out)]
    if run["timeline"] is not None:
        if run["timeline"]["memory_events"]:  # a timeline of no rank has no memory to draw
            paths.append(draw_memory(plt, run["timeline"], out))
        paths.append(draw_comm(plt, run["timeline"], out))
    plt.close("all")
    return paths


def add_arguments(parser):
    parser.add_argument("run", help="a JSON-lines file written by mpifsdp.StepMetrics")
    parser.add_argument("--out", help="directory for the PNGs (default: the run file's)")


def run_cli(args) -> int:
    try:
        paths = draw(args.run, args.out)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"mpifsdp pictures: {exc}") from exc
    for path in paths:
        print(path)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpifsdp pictures", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
