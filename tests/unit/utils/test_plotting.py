"""Tests for ``opd.run.plotting``: reading metrics.jsonl, curves PNG, summary, ``opd plot``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from opd.run.logger import Logger, LoggerConfig
from opd.run.plotting import main, plot_curves, read_metrics, write_summary
from opd.utils.errors import DataError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_STEPS = 30
VAL_STEPS = (0, 15, 30)


def train_record(step: int) -> dict:
    return {
        "step": step,
        "time": round(1.5 * step, 3),
        "train/loss": 2.0 / step + (0.3 if step == 7 else 0.0),
        "train/kl_forward": 1.0 / step,
        "train/kl_reverse": 0.5 / step + 0.01,
        "train/on_policy": step % 2,
        "timing/generation": 0.1 * (step % 3),
        "timing/step": 1.0 + 0.01 * step,
        "perf/tokens_per_s": 1000.0 + step,
        "perf/peak_memory_mb": 500.0 + (step % 7) * 10,
    }


def val_record(step: int, index: int, accuracy: bool = True) -> dict:
    record = {
        "step": step,
        "time": round(1.5 * step + 0.7, 3),
        "val/kl_forward": [0.8, 0.3, 0.35][index],
        "val/kl_reverse": [0.6, 0.25, 0.2][index],
        "timing/validation": [2.0, 3.0, 4.0][index],
    }
    if accuracy:
        record["val/accuracy"] = [0.1, 0.4, 0.35][index]
    return record


def write_run(run_dir: Path, accuracy: bool = True) -> tuple[Path, list[dict]]:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True)
    records = [val_record(0, 0, accuracy)]
    for step in range(1, NUM_STEPS + 1):
        records.append(train_record(step))
        if step in VAL_STEPS:
            records.append(val_record(step, VAL_STEPS.index(step), accuracy))
        if step in (15, 30):  # the training loop logs checkpoint time as a record of its own
            records.append({"step": step, "time": round(1.5 * step + 0.9, 3), "timing/checkpoint": step / 30})
    path = log_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path, records


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def number(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in summary:\n{text}"
    return float(match.group(1))


FLOAT = r"([-+0-9.e]+)"


# --------------------------------------------------------------------------- reading


def test_read_metrics_accepts_file_or_directory_and_restores_non_finite(tmp_path):
    path, records = write_run(tmp_path / "run")
    assert read_metrics(path) == records
    assert read_metrics(path.parent) == records
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n" + json.dumps({"step": 31, "train/loss": "nan", "train/grad_norm": "inf"}) + "\n")
    last = read_metrics(path)[-1]
    assert math.isnan(last["train/loss"]) and last["train/grad_norm"] == math.inf


def test_read_metrics_reads_what_the_logger_writes(tmp_path):
    logger = Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), console=False), total_steps=2)
    logger.log_metrics({"train/loss": 1.0, "train/kl_forward": float("nan")}, step=1)
    logger.log_metrics({"val/accuracy": 0.5}, step=1)
    logger.close()
    records = read_metrics(tmp_path / "logs")
    assert records[0]["train/loss"] == 1.0 and math.isnan(records[0]["train/kl_forward"])
    assert records[1]["val/accuracy"] == 0.5


def test_malformed_line_is_a_data_error_naming_file_and_line(tmp_path):
    path, _ = write_run(tmp_path / "run")
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(4, '{"step": 4, "train/loss": ')  # becomes line 5
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_metrics(path)
    assert str(path) in str(error.value) and "line 5" in str(error.value)


def test_record_without_step_is_a_data_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 1.0}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        read_metrics(path)
    path.write_text('{"train/loss": 1.0}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 1 has no integer 'step'"):
        read_metrics(path)


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_metrics(tmp_path / "nope")


# --------------------------------------------------------------------------- curves


def test_plot_curves_writes_png_next_to_metrics(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (opd[logging])")
    path, _ = write_run(tmp_path / "my-run")
    output = plot_curves(path.parent)
    assert output == path.parent / "curves.png"
    assert output.stat().st_size > 10_000
    width, height = png_size(output)
    # Four panels in a 2 x 2 grid.
    assert 1000 <= width <= 1400 and 700 <= height <= 900, (width, height)


def test_plot_curves_adapts_panels(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (opd[logging])")
    full = plot_curves(write_run(tmp_path / "full")[0])
    without_accuracy_path, _ = write_run(tmp_path / "no-acc", accuracy=False)
    without_accuracy = plot_curves(without_accuracy_path, tmp_path / "out" / "no-acc.png")
    assert without_accuracy == tmp_path / "out" / "no-acc.png"
    assert png_size(without_accuracy) == png_size(full)  # 3 panels still fill a 2 x 2 grid
    # Only the training loss: a single panel, one column.
    loss_only = tmp_path / "loss-only" / "metrics.jsonl"
    loss_only.parent.mkdir()
    loss_only.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 6)))
    width, height = png_size(plot_curves(loss_only))
    assert width < png_size(full)[0] and height < png_size(full)[1]


def test_plot_curves_title_is_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (opd[logging])")
    from matplotlib.figure import Figure

    titles = []
    original = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, text, **kw: titles.append(text) or original(self, text, **kw))
    plot_curves(write_run(tmp_path / "my-run")[0])
    assert titles == ["my-run"]


def test_plot_curves_with_nothing_to_plot_is_a_data_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "perf/tokens_per_s": 5.0}\n', encoding="utf-8")
    with pytest.raises(DataError, match="nothing to plot"):
        plot_curves(path)


# --------------------------------------------------------------------------- summary


def test_write_summary_numbers(tmp_path):
    path, records = write_run(tmp_path / "run")
    text = write_summary(path)
    assert (path.parent / "summary.txt").read_text(encoding="utf-8") == text
    train = [r for r in records if "train/loss" in r]
    val = [r for r in records if any(key.startswith("val/") for key in r)]
    losses = [r["train/loss"] for r in train]

    assert number(text, r"train steps: (\d+)") == NUM_STEPS
    assert number(text, rf"train/loss: first {FLOAT}") == pytest.approx(losses[0], rel=1e-5)
    assert number(text, rf"train/loss: first \S+ at step \d+, last {FLOAT}") == pytest.approx(losses[-1], rel=1e-5)
    assert number(text, rf"train/loss: .*min {FLOAT}") == pytest.approx(min(losses), rel=1e-5)
    assert number(text, r"train/loss: .*min \S+ at step (\d+)") == train[losses.index(min(losses))]["step"]
    for key in ("train/kl_forward", "train/kl_reverse"):
        values = [r[key] for r in train]
        assert number(text, rf"{key}: first {FLOAT}") == pytest.approx(values[0], rel=1e-5)
        assert number(text, rf"{key}: first \S+ at step \d+, last {FLOAT}") == pytest.approx(values[-1], rel=1e-5)
        assert number(text, rf"{key}: .*mean of first 5 {FLOAT}") == pytest.approx(sum(values[:5]) / 5, rel=1e-5)
        assert number(text, rf"{key}: .*mean of last 5 {FLOAT}") == pytest.approx(sum(values[-5:]) / 5, rel=1e-5)

    accuracy = [r["val/accuracy"] for r in val]
    assert number(text, rf"val/accuracy: first {FLOAT}") == accuracy[0]
    assert number(text, rf"val/accuracy: first \S+ at step \d+, last {FLOAT}") == accuracy[-1]
    assert number(text, rf"val/accuracy: .*best \(max\) {FLOAT}") == max(accuracy)
    assert number(text, r"val/accuracy: .*best \(max\) \S+ at step (\d+)") == 15
    kl_reverse = [r["val/kl_reverse"] for r in val]
    assert number(text, rf"val/kl_reverse: .*best \(min\) {FLOAT}") == min(kl_reverse)
    assert number(text, r"val/kl_reverse: .*best \(min\) \S+ at step (\d+)") == 30
    assert number(text, r"val/kl_forward: .*best \(min\) \S+ at step (\d+)") == 15

    assert number(text, rf"total time: {FLOAT} s") == pytest.approx(max(r["time"] for r in records))
    step_times = [r["timing/step"] for r in train]
    assert number(text, rf"timing/step: mean {FLOAT} s per step") == pytest.approx(
        sum(step_times) / len(step_times), rel=1e-5
    )
    generation = [r["timing/generation"] for r in train]
    mean_generation = sum(generation) / len(generation)
    assert number(text, rf"timing/generation: mean {FLOAT}") == pytest.approx(mean_generation, rel=1e-5)
    assert number(text, rf"timing/validation: mean {FLOAT} s per validation") == pytest.approx(3.0)
    assert number(text, rf"timing/checkpoint: mean {FLOAT} s per checkpoint") == pytest.approx(0.75)
    tokens = [r["perf/tokens_per_s"] for r in train]
    assert number(text, rf"perf/tokens_per_s: mean {FLOAT}") == pytest.approx(sum(tokens) / len(tokens), rel=1e-5)
    assert number(text, rf"perf/peak_memory_mb: max {FLOAT}") == max(r["perf/peak_memory_mb"] for r in train)


def test_write_summary_custom_output_and_no_validation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(train_record(s)) + "\n" for s in (1, 2, 3)), encoding="utf-8")
    output = tmp_path / "elsewhere" / "s.txt"
    text = write_summary(path, output)
    assert output.read_text(encoding="utf-8") == text
    assert "train steps: 3" in text and "val/" not in text
    assert not (tmp_path / "summary.txt").exists()


def test_summary_keeps_latest_record_of_a_repeated_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 9.0}, {"step": 2, "train/loss": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    text = write_summary(path)
    assert "train steps: 2" in text
    assert number(text, rf"train/loss: first \S+ at step \d+, last {FLOAT}") == 2.0


# --------------------------------------------------------------------------- command line


def test_main_writes_png_and_summary(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (opd[logging])")
    path, _ = write_run(tmp_path / "run")
    assert main([str(path.parent)]) == 0
    out = capsys.readouterr().out
    png, summary = path.parent / "curves.png", path.parent / "summary.txt"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert str(png) in out and str(summary) in out
    assert summary.read_text(encoding="utf-8") in out

    custom = tmp_path / "plots" / "c.png"
    assert main([str(path), "--output", str(custom)]) == 0
    assert custom.read_bytes()[:8] == PNG_SIGNATURE


def test_main_missing_path_returns_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opd: error: ") and "missing" in err


def test_main_malformed_file_returns_2(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 1.0}\nnot json\n', encoding="utf-8")
    assert main([str(path)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_main_usage_error_returns_2(capsys):
    assert main([]) == 2
    assert "usage: opd plot" in capsys.readouterr().err
