"""The benchmark scripts' PNGs (`--plot_dir`): scripts/bench_plots.py on small tables,
and the scripts end to end on tiny subsets (the full benchmarks take minutes)."""

import importlib
import pathlib

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def scripts(monkeypatch):
  monkeypatch.syspath_prepend(str(SCRIPTS))
  return lambda name: importlib.import_module(name)


def _compiled_rows():
  return [dict(plan=p, pred_mib=m, xla_mib=1.1 * m, bare_mib=1.2 * m, pred_gib=g,
               xla_gib=0.9 * g, bare_gib=g) for p, m, g in
          (("search", 1.0, 0.5), ("megatron", 2.0, 0.3), ("fsdp", 3.0, 0.1))]


@pytest.mark.parametrize("name, make", [
    ("compiled", lambda p: p.compiled(_compiled_rows(), "title")),
    ("fold", lambda p: p.fold_vs_unfolded(
        [dict(layers=n, folded_s=0.3, unfolded_s=n * 1.5, folded_ms=n * 0.1,
              unfolded_ms=n * 0.1) for n in (2, 4, 8)])),
    ("flat", lambda p: p.flatness({12: 0.3, 24: 0.31, 48: 0.33})),
    ("rediscover", lambda p: p.rediscovery(
        {"gpt": [dict(plan="search", ms=1.0, mib=2.0, gib=0.1),
                 dict(plan="megatron", ms=1.5, mib=3.0, gib=0.2)],
         "llama": [dict(plan="search", ms=2.0, mib=1.0, gib=0.3),
                   dict(plan="fsdp", ms=2.5, mib=4.0, gib=0.05)]})),
    # An infeasible budget (ms None) is drawn as a line, not a point.
    ("memory", lambda p: p.memory_budget(
        [dict(budget_gib=1.0, memory_gib=0.9, ms=2.0),
         dict(budget_gib=0.8, memory_gib=0.7, ms=2.5),
         dict(budget_gib=0.6, memory_gib=None, ms=None)], 1.1)),
])
def test_each_figure_saves_a_png(scripts, tmp_path, name, make):
  plots = scripts("bench_plots")
  path = plots.save(make(plots), str(tmp_path / "new"), name)
  assert path == str(tmp_path / "new" / f"{name}.png")
  data = pathlib.Path(path).read_bytes()
  assert data[:8] == PNG and len(data) > 5000


def test_bench_search_quick_flat_writes_its_plot(scripts, tmp_path, capsys):
  scripts("bench_search").main(["--quick", "--only=flat", f"--plot_dir={tmp_path}"])
  out = capsys.readouterr().out
  assert "L=  8" in out and "ratio 8/2" in out
  assert (tmp_path / "search_flat.png").read_bytes()[:8] == PNG


def test_bench_compiled_subset_writes_its_plot(scripts, tmp_path, capsys):
  scripts("bench_compiled").main(["--config=tiny", "--layers=1", "--seq=32",
                                  "--plans=megatron", f"--plot_dir={tmp_path}"])
  table = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in table[2:-1]] == ["megatron"]
  assert (tmp_path / "compiled.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("script, argv, message", [
    ("bench_compiled", ["--config=tiny", "--layers=1", "--plans=nope"], "--plans: unknown"),
    ("bench_search", ["--only=nope"], "--only: unknown section"),
])
def test_bad_selection_names_the_choices(scripts, capsys, script, argv, message):
  with pytest.raises(SystemExit):
    scripts(script).main(argv)
  assert message in capsys.readouterr().err
