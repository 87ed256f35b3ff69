"""PNG figures of the benchmark tables, next to the text the scripts print.

`scripts/bench_compiled.py --plot_dir D` and `scripts/bench_search.py --plot_dir D`
import this module (only then: the benchmarks run without matplotlib) and pass it the
rows they printed. Each function takes those rows and returns a matplotlib `Figure`;
`save` writes one as `D/<name>.png`. The Agg backend: files only, no display needed.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["compiled", "flatness", "fold_vs_unfolded", "memory_budget", "rediscovery", "save"]


def save(fig, plot_dir: str, name: str) -> str:
  """Writes `fig` to `plot_dir/name.png` (the folder made if missing), closes it, and
  returns the path."""
  os.makedirs(plot_dir, exist_ok=True)
  path = os.path.join(plot_dir, f"{name}.png")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


def _bars(ax, labels: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str):
  """Grouped bars: one group per label, one bar per series."""
  width = 0.8 / len(series)
  for k, (name, values) in enumerate(series.items()):
    xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
    ax.bar(xs, values, width, label=name)
  ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)


def compiled(rows: Sequence[Mapping], title: str):
  """bench_compiled: per plan, predicted vs compiled bytes sent and memory per device.

  Args:
    rows: dicts with `plan`, `pred_mib`, `xla_mib`, `bare_mib` (compiled with in_specs
      only), `pred_gib`, `xla_gib`, `bare_gib`.
    title: what was compiled (model, mesh, profile).
  """
  labels = [r["plan"] for r in rows]
  fig, (comm, mem) = plt.subplots(1, 2, figsize=(12, 4.2))
  _bars(comm, labels, {"predicted": [r["pred_mib"] for r in rows],
                       "compiled (tapas.apply)": [r["xla_mib"] for r in rows],
                       "compiled (in_specs only)": [r["bare_mib"] for r in rows]},
        "MiB sent per device per step")
  _bars(mem, labels, {"predicted": [r["pred_gib"] for r in rows],
                      "compiled (tapas.apply)": [r["xla_gib"] for r in rows],
                      "compiled (in_specs only)": [r["bare_gib"] for r in rows]},
        "GiB per device")
  comm.set_title("communication")
  mem.set_title("memory")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig


def fold_vs_unfolded(rows: Sequence[Mapping]):
  """bench_search fold: search seconds and objective vs depth, folded and unfolded.

  Args:
    rows: dicts with `layers`, `folded_s`, `unfolded_s`, `folded_ms`, `unfolded_ms`.
  """
  layers = [r["layers"] for r in rows]
  fig, (time_ax, obj_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
  time_ax.plot(layers, [r["folded_s"] for r in rows], "o-", label="folded (elimination)")
  time_ax.plot(layers, [r["unfolded_s"] for r in rows], "s--", label="unfolded (ILP)")
  time_ax.set_yscale("log")
  time_ax.set_ylabel("search seconds")
  obj_ax.plot(layers, [r["folded_ms"] for r in rows], "o-", label="folded")
  obj_ax.plot(layers, [r["unfolded_ms"] for r in rows], "s--", label="unfolded")
  obj_ax.set_ylabel("predicted ms/step")
  for ax in (time_ax, obj_ax):
    ax.set_xlabel("layers")
    ax.set_xticks(layers)
    ax.legend(fontsize=8)
  fig.suptitle("folded vs unfolded search", fontsize=10)
  fig.tight_layout()
  return fig


def flatness(times: Mapping[int, float]):
  """bench_search flat: folded search seconds (best of 3) vs depth."""
  fig, ax = plt.subplots(figsize=(5, 3.5))
  layers = sorted(times)
  ax.plot(layers, [times[n] for n in layers], "o-")
  ax.set_ylim(0, 1.2 * max(times.values()))
  ax.set_xticks(layers)
  ax.set_xlabel("layers")
  ax.set_ylabel("search seconds (best of 3)")
  ax.set_title("folded search time vs depth")
  fig.tight_layout()
  return fig


def rediscovery(results: Mapping[str, Sequence[Mapping]]):
  """bench_search rediscover: searched plan vs baselines, one panel per model.

  Args:
    results: model label -> dicts with `plan`, `ms`, `mib`, `gib`.
  """
  fig, axes = plt.subplots(len(results), 3, figsize=(12, 3.2 * len(results)), squeeze=False)
  for row, (model, plans) in zip(axes, results.items()):
    labels = [p["plan"] for p in plans]
    for ax, key, ylabel in zip(row, ("ms", "mib", "gib"),
                               ("predicted ms/step", "MiB sent/device", "GiB state/device")):
      bars = ax.bar(labels, [p[key] for p in plans],
                    color=["tab:green" if lab == "search" else "tab:gray" for lab in labels])
      ax.bar_label(bars, fmt="%.3g", fontsize=7)
      ax.set_ylabel(ylabel)
      ax.tick_params(axis="x", labelsize=8, rotation=20)
    row[0].set_title(model, loc="left", fontsize=9)
  fig.suptitle("searched plan vs expert layouts (predicted)", fontsize=10)
  fig.tight_layout()
  return fig


def memory_budget(rows: Sequence[Mapping], unconstrained_gib: float):
  """bench_search memory: the plan's memory and step time as the budget tightens.

  Args:
    rows: dicts with `budget_gib` and, for a feasible budget, `memory_gib` and `ms`
      (None or absent when infeasible).
    unconstrained_gib: the memory of the plan searched without a budget.
  """
  feasible = [r for r in rows if r.get("ms") is not None]
  fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 3.8))
  budgets = [r["budget_gib"] for r in feasible]
  mem.plot(budgets, [r["memory_gib"] for r in feasible], "o-", label="plan memory")
  mem.plot(budgets, budgets, ":", color="gray", label="budget")
  mem.axhline(unconstrained_gib, color="tab:red", lw=0.8, label="no budget")
  mem.set_ylabel("GiB per device")
  step.plot(budgets, [r["ms"] for r in feasible], "o-")
  step.set_ylabel("predicted ms/step")
  infeasible = [r["budget_gib"] for r in rows if r.get("ms") is None]
  for ax in (mem, step):
    ax.set_xlabel("memory budget, GiB per device")
    ax.invert_xaxis()   # tighter to the right
    for b in infeasible:
      ax.axvline(b, color="tab:red", ls="--", lw=0.8)
  mem.legend(fontsize=8)
  fig.suptitle("memory budget (dashed red: infeasible)", fontsize=10)
  fig.tight_layout()
  return fig
