"""scripts/train.py run as users run it: in a subprocess, tiny GPT, a few steps."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import tapas_jax as tapas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
TINY = os.path.join(ROOT, "configs", "gpt2.py") + ":tiny"
PREPARE = os.path.join(ROOT, "scripts", "prepare_data.py")


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True,
                        env=env, timeout=timeout, cwd=ROOT)


def launch_processes(n: int, *args: str, timeout: float = 300) -> list:
  """`n` launcher processes of one jax.distributed job on this host, 8 / n CPU devices each.

  Returns:
    (returncode, stdout, stderr) per process.
  """
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen(
      [sys.executable, TRAIN, *args, f"--host_devices={8 // n}",
       f"--coordinator_address=localhost:{port}", f"--num_processes={n}",
       f"--process_id={i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=env, cwd=ROOT) for i in range(n)]
  try:
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]
  finally:
    for p in procs:
      p.kill()


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_trains_writes_and_resumes_with_another_plan(tmp_path):
  """A run that stops and resumes (under another strategy) continues the same loss curve;
  two processes of one jax.distributed job compute it too, process 0 alone reporting."""
  straight, resumed, pair = tmp_path / "straight", tmp_path / "resumed", tmp_path / "pair"
  common = (f"--config={TINY}", "--mesh=data:2,model:4")
  runs = [launch(*common, "--steps=3", f"--workdir={straight}"),
          launch(*common, "--steps=2", f"--workdir={resumed}"),
          # Resumed under another plan, its state in the compiler's layouts.
          launch(*common, "--steps=3", f"--workdir={resumed}", "--strategy=fsdp",
                 "--layouts=auto")]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  lead, other = launch_processes(2, *common, "--steps=3", f"--workdir={pair}")
  assert lead[0] == other[0] == 0, (lead[2][-3000:], other[2][-3000:])
  # Gloo (the CPU collectives) prints connection lines from C++ threads, interleaved:
  # look for the launcher's own output instead of an empty stdout.
  assert "3/3 step loss" in lead[1]
  for marker in ("model ", "stage ", "Plan ", "loss", "checkpoint"):
    assert marker not in other[1], other[1][-2000:]
  assert os.listdir(pair / "checkpoints") == ["3"]
  assert sorted(os.listdir(straight)) == ["checkpoints", "config.json", "metrics.jsonl",
                                          "plan.json", "plan.txt"]
  json.loads((straight / "plan.json").read_text())
  assert "restore step 2" in runs[2].stdout
  for stage in ("stage trace", "stage compile", "first step", "tokens/s", "MFU"):
    assert stage in runs[0].stdout, stage
  want, got = metrics(straight), metrics(resumed)
  assert [m["step"] for m in want] == [m["step"] for m in got] == [1, 2, 3]
  for m in want:
    assert m["step_s"] > 0 and m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1
  # Same init and data: the resumed run's third step is the straight run's third step.
  for a, b, c in zip(want, got, metrics(pair)):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert c["loss"] == pytest.approx(a["loss"], rel=1e-4)
  assert want[-1]["loss"] < want[0]["loss"] - 1.0  # the synthetic data is learnable


def test_trains_on_a_token_file_resumes_its_input_and_splits_it_over_processes(tmp_path):
  """The repository's own text as byte tokens: a run stopped and resumed reads the same
  batches (same losses, same eval losses) as one that never stopped, and two processes,
  each reading only its half of every global batch, compute the same losses as one."""
  corpus = tmp_path / "corpus.bin"
  sources = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "scripts", "train.py")]
  prepared = subprocess.run([sys.executable, PREPARE, *sources, str(corpus)],
                            capture_output=True, text=True, timeout=60)
  assert prepared.returncode == 0, prepared.stderr
  text = b"".join(open(f, "rb").read() for f in sources)
  assert np.fromfile(corpus, "<u2").tolist() == list(text)  # one token per byte
  straight, resumed, pair = tmp_path / "straight", tmp_path / "resumed", tmp_path / "pair"
  common = (f"--config={TINY}", "--mesh=data:2,model:4", f"--config.data=tokens:{corpus}",
            "--config.eval_every=2", "--config.eval_steps=2")
  runs = [launch(*common, "--steps=4", f"--workdir={straight}"),
          launch(*common, "--steps=2", f"--workdir={resumed}"),
          launch(*common, "--steps=4", f"--workdir={resumed}")]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  assert "restore step 2" in runs[2].stdout
  assert "process 0 reads 8 of the 8 rows of each global batch" in runs[0].stdout
  assert "4/4 step loss" in runs[0].stdout and "eval loss" in runs[0].stdout
  saved = json.loads(next((resumed / "checkpoints" / "4" / "data").iterdir()).read_text())
  assert saved["position"] == {"next_index": 4} and saved["file"] == str(corpus)
  lead, other = launch_processes(2, *common, "--steps=4", f"--workdir={pair}")
  assert lead[0] == other[0] == 0, (lead[2][-3000:], other[2][-3000:])
  assert "process 0 reads 4 of the 8 rows of each global batch" in lead[1]
  want = metrics(straight)
  assert [m["step"] for m in want] == [1, 2, 3, 4]
  assert [m["step"] for m in want if "eval_loss" in m] == [2, 4]
  for got in (metrics(resumed), metrics(pair)):
    for a, b in zip(want, got, strict=True):
      assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
      assert b.get("eval_loss", 0) == pytest.approx(a.get("eval_loss", 0), rel=1e-4)
  # A language model's loss: it starts near log(256) (uniform over bytes) and falls.
  assert 5.0 < want[0]["loss"] < 7.0 and want[-1]["loss"] < want[0]["loss"] - 0.5
  assert want[-1]["eval_loss"] < want[1]["eval_loss"]


def test_trains_on_npy_images(tmp_path):
  """Image families read an images .npy and a labels .npy the same way (ViT here)."""
  rng = np.random.default_rng(0)
  np.save(tmp_path / "images.npy", rng.random((40, 32, 32, 3), np.float32))
  np.save(tmp_path / "labels.npy", rng.integers(0, 10, 40))
  run = launch(f"--config={ROOT}/configs/vit.py:tiny", "--mesh=data:2,model:4", "--steps=2",
               f"--config.data=images:{tmp_path}/images.npy,{tmp_path}/labels.npy",
               "--config.eval_every=1", "--config.eval_steps=2", f"--workdir={tmp_path / 'run'}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "24 training and 16 held-out examples" in run.stdout
  got = metrics(tmp_path / "run")
  assert [m["step"] for m in got if "eval_loss" in m] == [1, 2]
  for m in got:
    assert m["images_per_s"] > 0 and 1.0 < m["eval_loss"] < 5.0  # log(10) = 2.3


@pytest.mark.parametrize("args,message", [
    (["none.txt", "out.bin"], "cannot read none.txt (No such file or directory)"),
    (["README.md", "no/such/dir/out.bin"], "cannot write no/such/dir/out.bin"),
    (["out.bin"], "usage: prepare_data.py TEXT_FILE"),
])
def test_prepare_data_refuses_bad_paths_and_writes_nothing(tmp_path, args, message):
  run = subprocess.run([sys.executable, PREPARE, *args], capture_output=True, text=True,
                       timeout=60, cwd=ROOT if args[0] == "README.md" else tmp_path)
  assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
  assert message in run.stderr and "Traceback" not in run.stderr
  assert not (tmp_path / "out.bin").exists() and not os.path.exists(os.path.join(ROOT, "no"))


def test_plan_only_needs_no_devices(tmp_path):
  run = launch(f"--config={TINY}", "--mesh=data:4,model:8", "--plan_only",
               "--device=tpu-v5e", "--compare", f"--workdir={tmp_path}")
  assert run.returncode == 0, run.stderr[-3000:]
  table = run.stdout[run.stdout.index("plans per device per step"):].splitlines()
  assert [line.split()[0] for line in table[2:6]] == ["tapas", "data_parallel", "fsdp",
                                                      "megatron"]
  assert sorted(os.listdir(tmp_path)) == ["config.json", "plan.json", "plan.txt"]
  plan = tapas.Plan.load(tmp_path / "plan.json")
  assert dict(plan.mesh_axes) == {"data": 4, "model": 8} and plan.device == "tpu-v5e"
  assert (tmp_path / "plan.txt").read_text().strip() == plan.summary().strip()


def test_nosequence_parallel_is_taken_by_every_strategy(tmp_path):
  """Sequence parallelism is on by default; turning it off is refused nowhere (a fixed
  layout has none to turn off), asking for it with a fixed layout is (BAD below)."""
  for strategy in ("tapas", "dp"):
    run = launch(f"--config={TINY}", "--mesh=data:2,model:4", "--plan_only",
                 f"--strategy={strategy}", "--nosequence_parallel",
                 f"--workdir={tmp_path / strategy}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / strategy / "plan.json").exists()


def test_plan_only_with_verify_saves_the_compilers_figures(tmp_path):
  pytest.importorskip("libtpu", reason="libtpu cannot be loaded (pip install "
                      "'tapas_jax[tpu]'): --verify is not tested")
  run = launch(f"--config={TINY}", "--mesh=data:2,model:2", "--plan_only",
               "--verify=v5p:2x2x1", f"--workdir={tmp_path}")
  assert run.returncode == 0, run.stderr[-3000:]
  plan = tapas.Plan.load(tmp_path / "plan.json")
  assert plan.device == "tpu-v5p"  # the topology's generation, no --device given
  assert plan.compiled.target == "v5p:2x2x1" and plan.compiled.fits
  assert "compiled for v5p:2x2x1: fits" in run.stdout


def _bad_plan(tmp_path):
  path = tmp_path / "garbage.json"
  path.write_text("{not json")
  return f"--strategy=plan:{path}"


def _token_file(tmp_path, tokens, *flags):
  path = tmp_path / "tokens.bin"
  np.asarray(tokens).tofile(path)
  return [f"--config.data=tokens:{path}", *flags]


def _unwritable(tmp_path):
  (tmp_path / "file").write_text("")
  return f"--workdir={tmp_path / 'file' / 'run'}"


BAD = [
    ("malformed_mesh", lambda p: ["--mesh=data2,model:4"], "--mesh=data2,model:4"),
    ("zero_axis", lambda p: ["--mesh=data:0,model:8"], "sizes are >= 1"),
    ("mesh_too_large", lambda p: ["--mesh=data:4,model:4"], "needs 16 devices"),
    ("unknown_key", lambda p: ["--config.model.num_layer=4"], "num_layers"),
    ("unknown_size", lambda p: [f"--config={TINY[:-5]}:huge"], "unknown size 'huge'"),
    ("unknown_model", lambda p: ["--config.family=bert"], "unknown model 'bert'"),
    ("unknown_strategy", lambda p: ["--strategy=zero"], "--strategy=zero"),
    ("missing_plan", lambda p: [f"--strategy=plan:{p / 'none.json'}"], "cannot read"),
    ("garbage_plan", lambda p: [_bad_plan(p)], "cannot read the plan file"),
    ("zero_steps", lambda p: ["--steps=0"], "--steps=0"),
    ("bad_budget", lambda p: ["--memory_budget=lots"], "--memory_budget=lots"),
    ("sp_fixed_layout", lambda p: ["--strategy=dp", "--sequence_parallel"],
     "--sequence_parallel: only the search"),
    ("unknown_device", lambda p: ["--device=tpu-v9"], "tpu-v9"),
    ("bad_topology", lambda p: ["--verify=v5p"], "--verify: verify='v5p' is not a TPU "
     "topology name"),
    ("verify_fixed_layout", lambda p: ["--strategy=fsdp", "--verify=v5p:2x2x1"],
     "--verify: only the search"),
    ("unwritable_workdir", lambda p: [_unwritable(p)], "not a writable directory"),
    ("does_not_fit", lambda p: ["--batch_size=4194304"], "cannot be met"),  # by the search
    ("unknown_data", lambda p: ["--config.data=parquet:x"], "choose learnable, random, "),
    ("missing_tokens", lambda p: [f"--config.data=tokens:{p / 'none.bin'}"],
     "none.bin: cannot read the token file (No such file or directory); give a readable"),
    ("partial_token", lambda p: _token_file(p, np.zeros(5001, np.uint8)),
     "tokens.bin: 5001 bytes is not a whole number of uint16 tokens"),
    ("token_over_vocab", lambda p: _token_file(p, np.full(5000, 300, np.uint16)),
     "tokens.bin: holds token id 300, at or above the model's vocab_size 256: set "
     "--config.model.vocab_size above it"),
    ("under_one_batch", lambda p: _token_file(p, np.zeros(200, np.uint16)),
     "fewer than one global batch of 8 (257 tokens); give a larger file or a smaller"),
    ("eval_split_too_large", lambda p: _token_file(p, np.zeros(5000, np.uint16),
                                                   "--config.eval_every=1",
                                                   "--config.eval_steps=20"),
     "tokens.bin: the held-out split (160 windows) leaves 0 of its 156 windows"),
    ("negative_eval_every", lambda p: ["--config.eval_every=-1"], "--config.eval_every=-1"),
]


@pytest.mark.parametrize("name,args,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, name, args, message):
  workdir = tmp_path / "run"
  extra = args(tmp_path)
  if not any(a.startswith("--workdir") for a in extra):
    extra.append(f"--workdir={workdir}")
  run = launch(f"--config={TINY}", "--steps=2", *extra)
  assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train.py: error:"), run.stderr[-3000:]
  assert message in lines[0]
  assert "Traceback" not in run.stdout + run.stderr
  assert not workdir.exists() or name == "does_not_fit" and \
      sorted(os.listdir(workdir)) in ([], ["config.json", "plan.json", "plan.txt"])


def test_a_saved_plan_trains(tmp_path):
  """`--plan_only` writes plan.json; `--strategy=plan:` trains with it, same losses, and
  refuses it for another model."""
  common = (f"--config={TINY}", "--mesh=data:2,model:4")
  planned = launch(*common, "--plan_only", f"--workdir={tmp_path / 'plan'}")
  assert planned.returncode == 0, planned.stderr[-3000:]
  path = tmp_path / "plan" / "plan.json"
  runs = [launch(*common, "--steps=2", "--config.eval_every=1", "--config.eval_steps=2",
                 f"--workdir={tmp_path / 'fresh'}"),
          launch(*common, "--steps=2", f"--strategy=plan:{path}",
                 f"--workdir={tmp_path / 'loaded'}")]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  for a, b in zip(metrics(tmp_path / "fresh"), metrics(tmp_path / "loaded")):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert 0 < a["eval_loss"] < 8 and "eval_loss" not in b  # fresh synthetic draws
  # The plan of another program is refused before anything is allocated or written.
  other = launch(f"--config={TINY}", "--config.model.d_model=128", "--steps=2",
                 f"--strategy=plan:{path}", f"--workdir={tmp_path / 'other'}")
  assert other.returncode == 2, other.stderr[-3000:]
  lines = other.stderr.strip().splitlines()
  assert len(lines) == 1 and "searched for another program" in lines[0], lines
  assert not (tmp_path / "other").exists()
