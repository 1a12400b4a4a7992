"""benchmarks/gpu_check.py in its CPU mode: the quick start trains like one device, every
op and configuration is predicted and measured, and the per-op prediction is the roofline
of the calibrated profile."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from autopar.mesh import DeviceSpec

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_check.py")
OPS = 12       # op cases on the CPU, each a forward row and a forward+backward row
CONFIGS = 6    # configurations, each a step row and a memory row


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One `--cpu` run (its own calibration cache, so calibration measures), as --out wrote it."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPAR_CACHE=str(tmp / "cache"))
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== 6. summary" in proc.stdout
    return json.loads(out.read_text())


def rows(result, section, suffix):
    return [r for r in result["rows"] if r["section"] == section and r["name"].endswith(suffix)]


def test_every_section_ran(result):
    assert result["errors"] == {}
    assert result["sections"] == ["quickstart", "calibrate", "ops", "configs"]
    assert result["predicted_with"] == "cpu-calibrated"


def test_quickstart_trains_like_one_device(result):
    qs = result["quickstart"]
    assert len(qs["losses"]) == len(qs["plain_losses"]) == 4
    for compiled, plain in zip(qs["losses"], qs["plain_losses"]):
        assert abs(compiled - plain) <= 1e-5
    assert qs["max_abs_diff"] <= 1e-5
    assert abs(qs["losses"][0] - math.log(128)) < 0.5    # gpt-tiny's 128-token vocabulary, untrained
    assert qs["losses"][-1] < qs["losses"][0]            # AdamW on one batch


def test_every_op_is_predicted_and_measured(result):
    fwd, both = rows(result, "ops", " fwd"), rows(result, "ops", " f+b")
    assert len(fwd) == len(both) == OPS
    for r in fwd + both:
        assert r["predicted"] > 0 and r["measured"] > 0 and r["preset"] > 0, r
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"])


def test_matmul_prediction_is_the_roofline(result):
    """matmul 256x256x256 in float32 on a CPU (eager: launch added to the work): forward
    2 m k n FLOPs and its three operands' bytes; backward 4 m k n FLOPs, twice the bytes,
    two kernels."""
    spec = DeviceSpec.from_dict(result["calibration"]["device"])
    rate, bandwidth, launch = spec.peak_flops("float32"), spec.mem_bandwidth, spec.op_latency
    m = k = n = 256
    nbytes = (m * k + k * n + m * n) * 4
    forward = launch + max(2 * m * k * n / rate, nbytes / bandwidth)
    backward = 2 * launch + max(4 * m * k * n / rate, 2 * nbytes / bandwidth)
    found = {r["name"]: r["predicted"] for r in result["rows"]}
    assert found["matmul square 256x256x256 fwd"] == pytest.approx(forward, rel=1e-9)
    assert found["matmul square 256x256x256 f+b"] == pytest.approx(forward + backward, rel=1e-9)


def test_every_config_is_predicted_and_measured(result):
    steps, memory = rows(result, "configs", " step"), rows(result, "configs", " memory")
    assert len(steps) == len(memory) == CONFIGS
    for r in steps:
        assert r["predicted"] > 0 and r["measured"] > 0 and r["preset"] > 0, r
    for r in memory:
        assert r["predicted"] > 0 and r["measured"] is None    # no allocator to read on the CPU
    mem = {r["name"][: -len(" memory")]: r["predicted"] for r in memory}
    # twice the batch holds more activations; full recomputation keeps fewer
    assert mem["gpt-tiny h128 b8x32"] > mem["gpt-tiny h128 b4x32"] > mem["gpt-tiny h128 b4x32 full recompute"]
    assert mem["llama-tiny d128 b8x32"] > mem["llama-tiny d128 b4x32"] > mem["llama-tiny d128 b4x32 selective"]


def test_summary_has_a_median_error_per_section(result):
    summary = result["summary"]
    assert summary["quickstart max |loss diff|"] <= 1e-5
    for key in ("ops f+b median |pred/meas - 1|", "ops fwd median |pred/meas - 1|",
                "configs step median |pred/meas - 1|"):
        assert 0 <= summary[key] < math.inf, key
    assert summary["configs memory median |pred/meas - 1|"] is None


def test_backends_section_steps_three_ways(tmp_path):
    """`--sections backends` (asked for by name on the CPU): autopar eager, autopar inductor
    and torch.compile of the plain model each measured (on a GPU the plain model twice: float32
    weights under autocast, autopar's recipe, and every weight in bfloat16), the autopar rows against their plans
    priced for that backend."""
    out = tmp_path / "backends.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPAR_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu", "--sections", "backends", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["errors"] == {}
    names = [r["name"] for r in got["rows"] if r["section"] == "backends"]
    assert names == ["llama-tiny autopar eager", "llama-tiny autopar inductor",
                     "llama-tiny torch.compile (float32 weights)"]
    for r in got["rows"]:
        assert r["measured"] > 0 and r["predicted"] > 0 and "tokens/s" in r["detail"], r
