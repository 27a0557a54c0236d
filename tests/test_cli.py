"""The README's main command, `alpa-lab demo`, run as a user runs it: a fresh process."""

import subprocess
import sys


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "alpa_lab", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_plans_runs_and_matches_unsharded():
    out = run_cli("demo", "--model", "mlp", "--steps", "2", "--cluster", "local:1x4")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "== mlp on local:1x4" in text and "Plan (alpa)" in text
    assert "step 1: loss" in text
    diff = float(text.split("max |sharded - unsharded| over the state after 2 steps: ")[1].split()[0])
    assert diff < 1e-4
    assert "predicted" in text and "compiled" in text


def test_demo_bad_cluster_is_a_clear_error():
    out = run_cli("demo", "--cluster", "local:two")
    assert out.returncode != 0
    assert "bad --cluster 'local:two'" in out.stderr and "local:HOSTSxDEVICES" in out.stderr
    out = run_cli("demo", "--cluster", "local:4x4")
    assert out.returncode != 0 and "ALPA_LAB_CPU_DEVICES=16" in out.stderr


def test_demo_pipelined():
    out = run_cli("demo", "--model", "mlp", "--steps", "2", "--cluster", "local:2x4", "--microbatches", "4", "--layers", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "pipelined: 4 micro-batches, 1f1b" in text and "Pipeline plan (alpa)" in text
    diff = float(text.split("max |sharded - unsharded| over the state after 2 steps: ")[1].split()[0])
    assert diff < 1e-4
    assert "host seconds per unit task: stage 0 forward" in text
