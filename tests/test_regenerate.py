"""benchmarks/regenerate.py: a committed report's recorded command, re-run into another folder."""

import datetime
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


@pytest.fixture(scope="module")
def regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", os.path.join(ROOT, "benchmarks", "regenerate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["regenerate"]


def _report(tmp_path, line, name="2026-01-02-x.md"):
    path = tmp_path / name
    path.write_text(f"# A report\n\n- device: cpu\n{line}\n\n| a | b |\n")
    return path


def test_every_committed_report_names_a_script_that_exists_or_is_refused_as_hand_written(regenerate):
    reports = [p for p in glob.glob(os.path.join(RESULTS, "*", "*.md")) if os.path.basename(p) not in ("RESULTS.md", "README.md")]
    scripts, refused = set(), []
    for path in reports:
        try:
            scripts.add(regenerate.recorded_command(regenerate.Path(path)).script)
        except ValueError as error:
            assert "records no benchmarks/*.py command" in str(error)
            refused.append(path)
    assert {"benchmarks/e2e_compare.py", "benchmarks/dense_part_step.py", "benchmarks/combine_results.py"} <= scripts
    assert all(os.path.isfile(os.path.join(ROOT, s)) for s in scripts), scripts
    assert len(refused) < len(reports) / 10, refused


def test_an_e2e_report_runs_its_driver_into_the_folder_with_the_run_folders_beside(regenerate, tmp_path):
    line = ("- driver: `benchmarks/e2e_compare.py --out /tmp/b/results --runs-dir /tmp/b/runs --name e2e-x-seed0 "
            "--recipes dhen_xl --seeds 0 --runs bf16,loka --steps 160`")  # fmt: skip
    recorded = regenerate.recorded_command(_report(tmp_path, line, "2026-01-02-e2e-x-seed0.md"))
    argv = regenerate.command_into(recorded, tmp_path / "out", {}, {})
    assert argv == [sys.executable, "benchmarks/e2e_compare.py", "--out", str(tmp_path / "out"), "--name", "e2e-x-seed0",
                    "--recipes", "dhen_xl", "--seeds", "0", "--runs", "bf16,loka", "--steps", "160"]  # fmt: skip
    today = datetime.date.today().isoformat()
    assert regenerate.written_json(recorded, tmp_path / "out") == tmp_path / "out" / f"{today}-e2e-x-seed0.json"


def test_environment_torchrun_and_an_output_path_named_as_the_report(regenerate, tmp_path):
    line = "Command: `TORCH_LOGS=recompiles torchrun --nproc_per_node=2 benchmarks/comms_step_time.py --steps 3 --out /root/out/x`"
    recorded = regenerate.recorded_command(_report(tmp_path, line))
    assert recorded.env == {"TORCH_LOGS": "recompiles"}
    argv = regenerate.command_into(recorded, tmp_path, {"steps": "5"}, {})
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "benchmarks/comms_step_time.py",
                    "--steps", "5", "--out", str(tmp_path / "2026-01-02-x")]  # fmt: skip


def test_an_input_of_the_device_call_is_refused_by_name_until_given(regenerate, tmp_path):
    line = "- command: `python benchmarks/dense_part_step.py --preset xl --plan /tmp/x/runs/plan.json --out /root/out/d`"
    recorded = regenerate.recorded_command(_report(tmp_path, line))
    with pytest.raises(ValueError, match=r"--plan reads /tmp/x/runs/plan.json, which is not here .* --set plan=PATH"):
        regenerate.command_into(recorded, tmp_path, {}, {})
    plan = "benchmarks/results/H100/2026-11-26-e2e-dhen-xl-fast-accum-rule-seed0-loka-plan.json"
    argv = regenerate.command_into(recorded, tmp_path, {"plan": plan}, {})
    assert argv[argv.index("--plan") + 1] == plan and argv[-1] == str(tmp_path / "2026-01-02-x")


def test_a_hand_written_report_is_refused_with_one_line(tmp_path):
    report = _report(tmp_path, "Command: `bash scripts/device_benchmarks.sh job x model=dhen_xl`")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "regenerate.py"), str(report), "--dry-run"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "records no benchmarks/*.py command" in proc.stderr


def test_a_combined_report_regenerates_its_missing_sources_first(regenerate, tmp_path, capsys):
    report = regenerate.Path(RESULTS) / "H100" / "2026-11-25-e2e-latest.md"
    recorded = regenerate.recorded_command(report)
    sources = [a for a in recorded.args if a.endswith(".json")]
    assert sources and not any(os.path.exists(os.path.join(ROOT, s)) for s in sources)  # raw JSON: not committed
    regenerate.regenerate(report, tmp_path, overrides={}, dry_run=True)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(sources) + 1 and all("benchmarks/e2e_compare.py" in line for line in printed[:-1])
    combine = printed[-1]
    assert "benchmarks/combine_results.py" in combine and f"--out {tmp_path / report.stem}" in combine
    today = datetime.date.today().isoformat()
    assert combine.count(f"{tmp_path}/{today}-") == len(sources) and "benchmarks/results/" not in combine


@pytest.mark.slow
def test_a_cpu_report_regenerates_as_committed(tmp_path):
    """The CPU rounding study: its recorded command, re-run here, writes the committed table again
    (the title's date, the machine line and the command line, which names the new folder, aside)."""
    committed = os.path.join(RESULTS, "cpu", "2026-11-27-gemm-output-rounding-sqnr.md")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "regenerate.py"), committed, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "2026-11-27-gemm-output-rounding-sqnr.log").exists()
    written = (tmp_path / "2026-11-27-gemm-output-rounding-sqnr.md").read_text().splitlines()
    expected = open(committed).read().splitlines()
    table = [line for line in expected if line.startswith("|")]
    assert len(table) >= 4 and [line for line in written if line.startswith("|")] == table
    command = f"- command: `python benchmarks/gemm_output_rounding_sqnr.py --out {tmp_path}/2026-11-27-gemm-output-rounding-sqnr`"
    assert command in written
