"""Expert layouts, as plans of the same type and costed by the same model as the search.

- `data_parallel`: the batch over every mesh axis, everything else replicated.
- `fsdp`: data parallel, plus every input of the state argument stored sharded over
  all axes on its largest divisible dim (ZeRO-3); it is gathered where it is used.
- `megatron`: the batch over the batch axes; on the other axes, attention heads and
  the MLP hidden dim (column-parallel, then row-parallel), found from the zoo's
  parameter paths. This one knows the zoo; the search never does.

Example:
  >>> import tapas_jax as tapas
  >>> from tapas_jax import baselines, models
  >>> m = models.get_model("gpt", "tiny")
  >>> plan = baselines.baseline("megatron", m.train_step(), m.abstract_state(),
  ...                           m.batch_spec(8), mesh={"data": 2, "model": 4},
  ...                           family="gpt")
  >>> plan.name
  'megatron'
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from typing import Any, Mapping, Sequence

from tapas_jax import api
from tapas_jax import options
from tapas_jax import plan as planlib
from tapas_jax import solver
# The report's data-parallel and FSDP figures: built by the search, named here too.
from tapas_jax.api import baseline_figures as figures

__all__ = ["BASELINES", "MEGATRON_SPLITS", "baseline", "figures"]

# Parameter path pattern -> the dim Megatron splits over the model axes.
_GPT = ((r"Attention/(query|key|value)/kernel$", 1), (r"MLP/fc1/kernel$", 1))
MEGATRON_SPLITS: Mapping[str, tuple[tuple[str, int], ...]] = {
    "gpt": _GPT, "gpt_nnx": _GPT, "vit": _GPT, "moe": _GPT,
    "llama": ((r"(q_proj|k_proj|v_proj)/kernel$", 1), (r"(gate_proj|up_proj)/kernel$", 1)),
    "llama_nnx": ((r"(q_proj|k_proj|v_proj)/kernel(/value)?$", 1),
                  (r"(gate_proj|up_proj)/kernel(/value)?$", 1)),
    "t5": ((r"(query|key|value)/kernel$", 1), (r"MLP/wi/kernel$", 1)),
    "resnet": (),
}
BASELINES = ("data_parallel", "fsdp", "megatron")


def _megatron_splits(paths, family: str) -> list[tuple[str, int]]:
  """(input path, dim of a layer's parameter) Megatron splits over the model axes."""
  return [(path, dim) for path in paths for pattern, dim in MEGATRON_SPLITS[family]
          if re.search(pattern, path)]


def baseline(name: str, fn, *args, mesh: Any, family: str | None = None, kwargs=None,
             remat: str | None = None, config: options.SearchConfig | None = None,
             **search_options: Any):
  """An expert plan for `fn(*args)`, costed like a searched one.

  Args:
    name: one of `BASELINES`.
    fn, *args: the program, as for `tapas_jax.search`.
    mesh: Mesh, abstract mesh or dict of axis sizes.
    family: zoo family name (needed by "megatron").
    kwargs: the step's keyword arguments, as for `tapas_jax.search`.
    remat: a `jax.checkpoint` policy (`solver.REMAT_POLICIES`: "everything_saveable",
      "dots_saveable", "nothing_saveable") for every unique layer with a backward, as
      expert recipes set one (MaxText's `remat_policy`: "full" is nothing_saveable,
      "minimal" saves the dots); costed as the search costs its own remat, and in
      `plan.remat` so that `tapas.apply` runs it. None: no remat.
    config: the search options as one `options.SearchConfig`; or
    **search_options: the same as keywords, as for `tapas_jax.search`. Of them a
      baseline reads `device`, `links`, `fold`, `batch_axes` (the axes Megatron puts
      the batch on; default: the axes whose names do not say they are meant for the
      model, `solver.data_axes`; data parallel and FSDP always use every
      axis) and `memory_budget` (the limit it warns over; default: the device's
      memory less headroom). The expert layouts need no solver and no sequence cuts.

  Raises:
    ValueError: unknown baseline name, family or remat policy, or a bad option (see
      `search`).
  """
  if name not in BASELINES:
    raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
  if remat is not None and remat not in solver.REMAT_POLICIES:
    raise ValueError(f"baseline remat={remat!r}: choose one of {solver.REMAT_POLICIES} "
                     "or None")
  if name == "megatron" and family not in MEGATRON_SPLITS:
    raise ValueError(f"megatron baseline: no layout known for model family {family!r}; "
                     f"pass family= one of {', '.join(sorted(MEGATRON_SPLITS))}")
  config = options.search_config(config, search_options, "baseline")
  prepared, solution, modes = _costed(name, fn, args, mesh=mesh, family=family,
                                      kwargs=kwargs, remat=remat, config=config)
  problem = prepared.problem
  plan = planlib.make_plan(prepared.folded, solution, args,
                           search_s=prepared.prepare_s + solution.solve_s,
                           name=name if not modes else f"{name}+{remat}",
                           kwargs=kwargs)
  limit = api.resolve_budget(config.memory_budget, problem.profile)
  if limit is not None and plan.stats.predicted_memory_bytes > limit:
    # A baseline is a fixed layout to compare against, so it is returned, but it says
    # so before anything runs.
    of = (f"{problem.profile.name}'s {limit / 2**30:.2f} GiB (device memory less "
          f"{api.HBM_HEADROOM:.0%} headroom)" if config.memory_budget is None else
          f"memory_budget={limit / 2**30:.2f} GiB")
    warnings.warn(f"baseline {name!r} takes {plan.stats.predicted_memory_bytes / 2**30:.2f} "
                  f"GiB per device, over {of}: it would not fit", stacklevel=2)
  return plan


def _costed(name: str, fn, args: Sequence[Any], *, mesh: Any, family: str | None,
            kwargs: Mapping[str, Any] | None, remat: str | None,
            config: options.SearchConfig
            ) -> tuple[api.Prepared, solver.Solution, dict[int, str]]:
  """(the program prepared as a baseline sees it, baseline `name` costed on it, the
  unique layers given its `remat` policy: those with a backward). `baseline`'s plan is
  made of them; scripts read them beside the compiler's figures
  (`scripts/tpu_peak.py --model_peak`)."""
  batch_axes = options.batch_axes(config.batch_axes, options.mesh_axes(mesh, "baseline"),
                                  "baseline")
  # The expert layouts name one layout per value dim: no sequence cuts to leave open.
  prepared = api.prepare(fn, args, mesh=mesh, kwargs=kwargs, where="baseline",
                         config=dataclasses.replace(config, batch_axes=None,
                                                    sequence_parallel=False))
  start = time.perf_counter()
  modes = {}
  if remat is not None:
    modes = {u.index: remat for u in prepared.folded.unique_layers
             if solver.layer_remats(prepared.folded, u.index, remat)}
  layout = _layout(name, prepared, family, batch_axes)
  solution = solver.evaluate(prepared.problem, layout, folded=prepared.folded, remat=modes)
  # Its seconds: choosing the layout is this search's work too.
  return (prepared, dataclasses.replace(solution, solve_s=time.perf_counter() - start),
          modes)


def _layout(name: str, prepared: api.Prepared, family: str | None,
            batch_axes: Sequence[str] | None) -> solver.LayoutChoice:
  """The class choice of baseline `name` on a program prepared as `baseline` prepares
  it (no batch axes, no sequence cuts)."""
  problem, mesh_spec = prepared.problem, prepared.mesh
  if name == "megatron":
    if batch_axes is None:
      batch_axes = solver.data_axes(mesh_spec)
    return solver.layout_choice(
        problem, batch_axes=tuple(batch_axes),
        split=_megatron_splits([i.path for i in prepared.graph.inputs], family or ""),
        split_axes=tuple(a for a in mesh_spec.axis_names if a not in batch_axes))
  every = tuple(a for a in mesh_spec.axis_names if mesh_spec.size(a) > 1)
  return solver.layout_choice(problem, batch_axes=every, fsdp=name == "fsdp")
