"""examples/quickstart.ipynb runs top to bottom on the 8-device CPU mesh.

The notebook runs in a subprocess: its first cell sets XLA_FLAGS, which only works
before jax starts, and this test process started jax long ago. No Jupyter needed: the
runner below reads the .ipynb JSON with the standard library and executes the code
cells in one namespace, as a kernel would (IPython magics skipped, a cell's last
expression displayed through `_repr_html_` or `repr`, matplotlib on Agg). Run by hand:

  python tests/notebook_test.py examples/quickstart.ipynb
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.ipynb"


class CellError(RuntimeError):
  """A code cell raised; says which cell and shows its source."""


def code_cells(notebook: dict) -> list[str]:
  """The code cells' sources, IPython magics and shell escapes left out."""
  if notebook.get("nbformat") != 4:
    raise ValueError(f"expected an nbformat 4 notebook, got nbformat "
                     f"{notebook.get('nbformat')!r}")
  out = []
  for cell in notebook["cells"]:
    if cell["cell_type"] != "code":
      continue
    source = cell["source"]
    source = "".join(source) if isinstance(source, list) else source
    if source.lstrip().startswith("%%"):
      continue  # a cell magic: the whole cell is another language
    out.append("\n".join(line for line in source.splitlines()
                         if not line.lstrip().startswith(("%", "!"))))
  return out


def display(value) -> str:
  """What a notebook shows for a value: its HTML if it has one, else its repr."""
  html = getattr(value, "_repr_html_", None)
  if callable(html):
    text = html()
    if not isinstance(text, str):
      raise TypeError(f"{type(value).__name__}._repr_html_ returned "
                      f"{type(text).__name__}, not str")
    return text
  return repr(value)


def run_cells(cells: list[str], namespace: dict | None = None) -> dict:
  """Executes the cells in one namespace, each cell's last expression displayed.

  Raises:
    CellError: a cell raised (chained to the original exception).
  """
  namespace = {"__name__": "__main__", "display": display} if namespace is None else namespace
  for i, source in enumerate(cells):
    try:
      tree = ast.parse(source, filename=f"<cell {i}>")
      last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
      exec(compile(tree, f"<cell {i}>", "exec"), namespace)  # noqa: S102 - the notebook
      if last is not None:
        value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"), namespace)
        if value is not None:
          display(value)
    except Exception as e:  # noqa: BLE001 - any failure of a cell fails the notebook
      raise CellError(f"code cell {i} raised {type(e).__name__}: {e}\n--- cell {i} ---\n"
                      f"{source}") from e
  return namespace


def run_notebook(path: str | os.PathLike) -> dict:
  """Runs the notebook's code cells top to bottom (matplotlib on Agg)."""
  import matplotlib  # noqa: PLC0415 - only the notebook's process needs it
  matplotlib.use("Agg")
  # plt.show() on Agg warns that it cannot show; a kernel would show the figure.
  warnings.filterwarnings("ignore", message=".*non-interactive.*")
  with open(path, encoding="utf-8") as f:
    return run_cells(code_cells(json.load(f)))


def _run(path: pathlib.Path, out_dir: pathlib.Path, timeout: float):
  env = dict(os.environ)
  # The notebook's first cell must set the device count itself, as it would in a fresh
  # kernel; the test session's own flag is not passed on.
  env.pop("XLA_FLAGS", None)
  env.update(MPLBACKEND="Agg", JAX_PLATFORMS="cpu", TAPAS_NOTEBOOK_OUT=str(out_dir),
             PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
                 os.pathsep))
  return subprocess.run([sys.executable, __file__, str(path)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def test_quickstart_runs(tmp_path):
  result = _run(QUICKSTART, tmp_path, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
  # What the notebook promises to write to TAPAS_NOTEBOOK_OUT.
  for name in ("gpt_tiny_plan.json", "loss.png", "shardings.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  for name in ("loss.png", "shardings.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
  # Imported here: the subprocess (this file as a script) must not import jax before the
  # notebook's first cell has set XLA_FLAGS.
  import tapas_jax as tapas  # noqa: PLC0415
  plan = tapas.Plan.load(tmp_path / "gpt_tiny_plan.json")
  assert dict(plan.mesh_axes) == {"data": 2, "model": 4}
  assert [layer.name for layer in plan.layers] == ["Block", "glue"]


def test_quickstart_is_valid_nbformat():
  notebook = json.loads(QUICKSTART.read_text())
  assert notebook["nbformat"] == 4 and notebook["nbformat_minor"] >= 5
  ids = [cell["id"] for cell in notebook["cells"]]
  assert len(set(ids)) == len(ids)
  for cell in notebook["cells"]:
    assert cell["cell_type"] in ("code", "markdown")
    assert isinstance(cell["source"], list) and isinstance(cell["metadata"], dict)
    if cell["cell_type"] == "code":
      # Committed with outputs cleared.
      assert cell["outputs"] == [] and cell["execution_count"] is None
  # The first code cell sets the device count, before anything imports jax.
  cells = code_cells(notebook)
  assert "xla_force_host_platform_device_count=8" in cells[0]
  assert "import jax" not in cells[0]


def _notebook(*sources: str) -> dict:
  return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
      {"cell_type": "code", "id": str(i), "metadata": {}, "outputs": [],
       "execution_count": None, "source": textwrap.dedent(s).splitlines(keepends=True)}
      for i, s in enumerate(sources)]}


@pytest.mark.parametrize("sources, expected", [
    # One namespace across cells.
    (("x = 2", "y = x * 3"), {"x": 2, "y": 6}),
    # Line magics and shell escapes skipped, cell magics skip the cell.
    (("%matplotlib inline\nx = 1", "!pip list\ny = 2", "%%bash\nexit 1"), {"x": 1, "y": 2}),
    # The last expression is displayed: its _repr_html_ runs.
    (("class H:\n  def _repr_html_(self):\n    return '<b>h</b>'\nh = H()", "h"), {}),
])
def test_runner_executes_cells(sources, expected):
  namespace = run_cells(code_cells(_notebook(*sources)))
  for name, value in expected.items():
    assert namespace[name] == value


@pytest.mark.parametrize("sources, message", [
    (("x = 1", "raise ValueError('boom')", "y = 2"), "code cell 1 raised ValueError: boom"),
    (("x = 1 +",), "code cell 0 raised SyntaxError"),
    # A broken _repr_html_ fails the cell as it would show an error in Jupyter.
    (("class H:\n  def _repr_html_(self):\n    return None\nH()",),
     "_repr_html_ returned NoneType"),
])
def test_runner_fails_when_a_cell_raises(sources, message):
  with pytest.raises(CellError, match=message):
    run_cells(code_cells(_notebook(*sources)))


def test_runner_stops_at_the_failing_cell():
  namespace = {"__name__": "__main__"}
  with pytest.raises(CellError):
    run_cells(code_cells(_notebook("a = 1", "1 / 0", "b = 2")), namespace)
  assert namespace["a"] == 1 and "b" not in namespace


if __name__ == "__main__":
  run_notebook(sys.argv[1])
