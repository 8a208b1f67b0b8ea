"""``shardfn schedule``: print, check, time and draw a pipeline schedule.

    shardfn schedule --name 1f1b --stages 4 --microbatches 8
    shardfn schedule --name interleaved_1f1b --stages 4 --microbatches 8 --virtual 2 --json
    shardfn schedule --file examples/schedules/zb_2x4.yaml --plot zb.png

``--stages`` is the number of pipeline ranks; with ``--virtual V`` each rank holds ``V`` stages.
The text output is the action table (one column per rank), the simulated timeline and a summary;
``--json`` prints one object with ``bubble``, ``makespan``, ``peak_inflight`` and the actions.
``python -m shardfn.cli.schedule --name zbh1 --stages 4 --microbatches 8`` runs it on its own.
Exit codes: 0 success, 1 a failure while running (e.g. no matplotlib for ``--plot``), 2 a bad
schedule or option (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from shardfn.partition.pipeline import schedules as S

HELP = "print, validate, time and plot a pipeline schedule (GPipe, 1F1B, interleaved, ZB-H1, DualPipeV)"

_COLORS = {"F": "#4C72B0", "B": "#C44E52", "I": "#DD8452", "W": "#55A868"}
_NAMES = {"F": "forward (F)", "B": "full backward (B)", "I": "backward-input (I)",
          "W": "backward-weight (W)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``schedule`` options to ``parser``.

    Example:
        p = argparse.ArgumentParser(); add_arguments(p); run(p.parse_args(["--json"]))
    """
    parser.add_argument("--name", default="1f1b",
                        help=f"generated schedule: {', '.join(S.SCHEDULES)} (default: 1f1b)")
    parser.add_argument("--file", metavar="FILE", default=None,
                        help="read the schedule from a .yaml or .csv table instead of --name")
    parser.add_argument("--stages", "--ranks", dest="ranks", type=int, default=4, metavar="P",
                        help="pipeline ranks (default: 4)")
    parser.add_argument("--microbatches", type=int, default=8, metavar="M",
                        help="microbatches per step (default: 8)")
    parser.add_argument("--virtual", type=int, default=None, metavar="V",
                        help="stages per rank (interleaved_1f1b: default 2)")
    parser.add_argument("--costs", default=None, metavar="K=T,...",
                        help="time units per action kind (default: F=1,B=2,I=1,W=1)")
    parser.add_argument("--comm-latency", type=float, default=0.0, metavar="T",
                        help="time units a tensor takes between ranks (default: 0)")
    parser.add_argument("--comm", action="store_true",
                        help="show the send/receive actions in the table")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (bubble, makespan, peak_inflight, actions, ...)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw the timeline as a PNG (needs matplotlib)")
    parser.add_argument("--save", metavar="FILE", default=None,
                        help="write the schedule, with its communication, as .yaml or .csv")


def run(args: argparse.Namespace) -> int:
    """Run ``shardfn schedule`` for parsed ``args``; return the exit code.

    Example:
        run(argparse.Namespace(**vars(parser.parse_args(["--name", "zbh1", "--json"]))))
    """
    try:
        sched = _schedule(args)
        costs = _parse_costs(args.costs)
        sim = S.simulate(sched, costs=costs, comm=args.comm_latency)
    except (ValueError, OSError) as e:
        print(f"shardfn schedule: error: {e}", file=sys.stderr)
        return 2
    if args.save:
        try:
            S.dump_schedule(sched, args.save)
        except (ValueError, OSError) as e:
            print(f"shardfn schedule: error: {e}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            plot_timeline(sched, sim, args.plot)
        except ImportError as e:
            print(f"shardfn schedule: error: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(summary(sched, sim)))
    else:
        print(_text(sched, sim, show_comm=args.comm))
    return 0


def _schedule(args: argparse.Namespace) -> S.Schedule:
    """The schedule the options name, validated and with its communication actions."""
    if args.file:
        sched = S.load_schedule(args.file)
        return S.validate(sched) if sched.has_communication else S.add_communication(sched)
    return S.get_schedule(args.name, args.ranks, args.microbatches, args.virtual)


def _parse_costs(text: Optional[str]) -> Optional[dict[str, float]]:
    if not text:
        return None
    costs = {}
    for item in text.split(","):
        kind, sep, value = item.partition("=")
        try:
            costs[kind.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--costs: cannot read {item!r}; write KIND=TIME pairs, e.g. "
                             f"F=1,B=2,I=1,W=1")
    return costs


def summary(sched: S.Schedule, sim: S.Simulation) -> dict:
    """The JSON view: sizes, costs, ``bubble``, ``makespan``, ``peak_inflight`` and the actions.

    Example:
        s = S.get_schedule("1f1b", 4, 8); summary(s, S.simulate(s))["bubble"]   # 0.2727...
    """
    return {
        "name": sched.name,
        "n_ranks": sched.n_ranks,
        "n_stages": sched.n_stages,
        "n_microbatches": sched.n_microbatches,
        "stage_to_rank": list(sched.stage_to_rank),
        "costs": dict(sim.costs),
        "bubble": sim.bubble,
        "makespan": sim.makespan,
        "peak_inflight": list(sim.peak_inflight),
        "actions": [[a.cell for a in acts] for acts in sched.actions],
    }


def _text(sched: S.Schedule, sim: S.Simulation, show_comm: bool) -> str:
    costs = " ".join(f"{k}={v:g}" for k, v in sim.costs.items())
    head = (f"{sched.name}: {sched.n_ranks} ranks, {sched.n_stages} stages, "
            f"{sched.n_microbatches} microbatches (costs {costs})")
    table = S.format_table(sched if show_comm else sched.compute_only())
    timeline = S.format_timeline(sched, sim)
    foot = [f"bubble         {sim.bubble:.4f}  (idle / (ranks * makespan))",
            f"makespan       {sim.makespan:g}",
            f"peak_inflight  {' '.join(map(str, sim.peak_inflight))}  (activations held, per rank)"]
    return "\n\n".join([head, table, "timeline (one column per time unit, . idle):\n" + timeline,
                        "\n".join(foot)])


def plot_timeline(sched: S.Schedule, sim: S.Simulation, path: str) -> str:
    """Draw ``sim``'s timeline as a PNG at ``path``: one row per rank, one box per action.

    Example:
        s = S.get_schedule("zbh1", 4, 8); plot_timeline(s, S.simulate(s), "zbh1.png")
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib "
                          "(or pip install 'shardfn[plot]')") from None
    width = min(max(8.0, 0.32 * sim.makespan + 1.5), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * sched.n_ranks + 1.6))
    kinds = set()
    for r, slots in enumerate(sim.timeline):
        local = sched.stages_of(r)
        for slot in slots:
            a = slot.action
            kinds.add(a.kind)
            chunk = local.index(a.stage)
            alpha = 1.0 if chunk == 0 else max(0.35, 1.0 - 0.3 * chunk)
            ax.barh(r, slot.end - slot.start, left=slot.start, height=0.8, color=_COLORS[a.kind],
                    alpha=alpha, edgecolor="white", linewidth=0.8)
            label = f"{a.microbatch}" if len(local) == 1 else f"{a.microbatch}\u2009s{a.stage}"
            ax.text((slot.start + slot.end) / 2, r, label, ha="center", va="center",
                    fontsize=7 if len(local) == 1 else 5.5, color="white")
    ax.set_yticks(range(sched.n_ranks), [f"rank {r}" for r in range(sched.n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (units: " + ", ".join(f"{k}={v:g}" for k, v in sim.costs.items()) + ")")
    ax.set_title(f"{sched.name}: {sched.n_ranks} ranks, {sched.n_stages} stages, "
                 f"{sched.n_microbatches} microbatches; bubble {sim.bubble:.1%}, "
                 f"makespan {sim.makespan:g}", fontsize=10)
    handles = [Patch(color=_COLORS[k], label=_NAMES[k]) for k in S.COMPUTE_KINDS if k in kinds]
    multi = any(len(sched.stages_of(r)) > 1 for r in range(sched.n_ranks))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22 if sched.n_ranks < 4
              else -0.15), ncol=len(handles), frameon=False, fontsize=8, title_fontsize=8,
              title="box: microbatch and stage (lighter: a rank's later stages)" if multi
              else "box: microbatch")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m shardfn.cli.schedule [options]``; returns the exit code.

    Example:
        main(["--name", "dualpipev", "--stages", "4", "--microbatches", "8"])
    """
    parser = argparse.ArgumentParser(prog="shardfn schedule", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
