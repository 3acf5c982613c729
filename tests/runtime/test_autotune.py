"""Autotune: the search over fusion thresholds and cycle times, its log, and a real 2-rank job tuning itself."""

import csv
import subprocess
import sys

import numpy as np
import pytest

from harness import assert_passed, launch
from spark_hvd.runtime.autotune import CYCLE_CANDIDATES, FUSION_CANDIDATES, LOG_FIELDS, Autotuner

MiB = 1024 * 1024


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_steps(tuner, clock, speed, steps, names=("a", "b")):
    """Feed ``steps`` training steps of two 1 MiB tensors; ``speed(setting)`` seconds per step."""
    changes = []
    for _ in range(steps):
        for name in names:
            clock.now += speed(tuner.current) / len(names)
            changed = tuner.observe([name], MiB)
            if changed is not None:
                changes.append(changed)
    return changes


def test_search_discards_warmup_tries_every_threshold_then_cycle_times_and_keeps_the_fastest(tmp_path):
    clock = Clock()
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(64 * MiB, 0.0, str(log), warmup_samples=2, steps_per_sample=3, max_samples=20, clock=clock)

    def speed(setting):
        fusion, cycle = setting
        # Fastest at 4 MiB and 1 ms; the warm-up setting is slow, so counting it would mislead.
        return 0.010 + abs(fusion - 4 * MiB) / MiB * 1e-3 + abs(cycle - 1.0) * 2e-3

    changes = _run_steps(tuner, clock, speed, 200)
    assert tuner.done
    assert tuner.current == tuner.best == (4 * MiB, 1.0)
    assert changes[-1] == (4 * MiB, 1.0)
    tried = [s for s in tuner.scores]
    assert [f for f, c in tried[:len(FUSION_CANDIDATES)]] == list(FUSION_CANDIDATES)
    assert {c for f, c in tried if f == 4 * MiB} == set(CYCLE_CANDIDATES)
    assert sum(len(v) for v in tuner.scores.values()) == 20  # the leftover samples re-measured the best ones
    rows = list(csv.DictReader(open(log)))
    assert tuple(rows[0].keys()) == LOG_FIELDS
    assert [r["phase"] for r in rows[:2]] == ["warmup", "warmup"]
    assert rows[-1]["phase"] == "best"
    assert (int(rows[-1]["fusion_threshold_bytes"]), float(rows[-1]["cycle_time_ms"])) == (4 * MiB, 1.0)
    trial = rows[2]
    assert int(trial["steps"]) == 3 and int(trial["bytes"]) > 0 and float(trial["score_bytes_per_s"]) > 0
    # Once done, nothing changes any more.
    assert _run_steps(tuner, clock, speed, 20) == []


def test_steps_are_counted_when_a_name_comes_again():
    clock = Clock()
    tuner = Autotuner(MiB, 0.0, warmup_samples=1, steps_per_sample=2, max_samples=3, clock=clock)
    for name in ["a", "b", "c"]:  # one step of three tensors: no repeat yet
        clock.now += 1
        tuner.observe([name], 10)
    assert tuner.samples_taken == 0
    for name in ["a", "b", "c", "a"]:  # "a" again twice: two steps done, the warm-up sample ends
        clock.now += 1
        tuner.observe([name], 10)
    assert tuner.samples_taken == 1 and tuner.current == (FUSION_CANDIDATES[0], 0.0)


def test_a_short_budget_stops_early_and_bad_arguments_are_refused(tmp_path):
    clock = Clock()
    tuner = Autotuner(MiB, 0.0, warmup_samples=0, steps_per_sample=1, max_samples=2, clock=clock)
    _run_steps(tuner, clock, lambda s: 0.01 + s[0] / MiB * 1e-3, 20)
    assert tuner.done and sum(len(v) for v in tuner.scores.values()) == 2
    assert tuner.current == (0, 0.0)
    with pytest.raises(ValueError, match="steps_per_sample=0 is invalid"):
        Autotuner(MiB, 0.0, steps_per_sample=0)
    with pytest.raises(ValueError, match="folder that does not exist"):
        Autotuner(MiB, 0.0, str(tmp_path / "missing" / "log.csv"))


def check_training_like_loop_tunes_and_stays_correct(hvd, rank, size):
    """Forty steps of three grouped gradients: every result is right while settings change."""
    for step in range(40):
        handles = [hvd.allreduce_async(np.full(1000 * (i + 1), rank + step + i, np.float32), name=f"g{i}",
                                       op=hvd.Sum) for i in range(3)]
        for i, handle in enumerate(handles):
            got = hvd.synchronize(handle)
            want = sum(r + step + i for r in range(size))
            assert np.all(got == want), (step, i, got[:3], want)
    return None


def test_two_ranks_tune_during_a_job_and_log_every_sample(tmp_path):
    log = tmp_path / "tune.csv"
    results = launch([check_training_like_loop_tunes_and_stays_correct], np=2,
                     env={"SPARK_HVD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                          "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": "1", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
                          "SPARK_HVD_AUTOTUNE_MAX_SAMPLES": "8"})
    assert_passed(results, check_training_like_loop_tunes_and_stays_correct)
    rows = list(csv.DictReader(open(log)))
    phases = [r["phase"] for r in rows]
    assert phases[0] == "warmup" and phases[-1] == "best", phases
    assert len([p for p in phases if p not in ("warmup", "best")]) == 8
    assert len({r["fusion_threshold_bytes"] for r in rows}) > 1  # settings really changed


def test_launcher_autotune_flags_reach_the_ranks(tmp_path):
    log = tmp_path / "tune.csv"
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, spark_hvd.runtime as hvd\n"
        "hvd.init()\n"
        "for step in range(30):\n"
        "    for i in range(2):\n"
        "        hvd.allreduce(np.ones(256, np.float32), name=f'w{i}')\n"
        "hvd.shutdown()\n")
    cli = [sys.executable, "-m", "spark_hvd.runner.cli", "-np", "2", "--autotune", "--autotune-log-file", str(log),
           "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2",
           "--autotune-bayes-opt-max-samples", "4", sys.executable, str(script)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader(open(log)))
    assert rows[0]["phase"] == "warmup" and rows[-1]["phase"] == "best", rows
    bad = subprocess.run([sys.executable, "-m", "spark_hvd.runner.cli", "-np", "2", "--autotune-steps-per-sample",
                          "0", sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--autotune-steps-per-sample" in bad.stderr
