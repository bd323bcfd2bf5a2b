"""Tests for ``opd.run.logger``: JSONL, TensorBoard, console, resume truncation, W&B, MLflow."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

import pytest

from opd.run.logger import Logger, LoggerConfig, flatten_dict
from opd.utils.errors import ConfigError


def make_logger(tmp_path: Path, total_steps: int = 10, **overrides) -> Logger:
    config = LoggerConfig(log_dir=str(tmp_path / "logs"), console=overrides.pop("console", False), **overrides)
    return Logger(config, total_steps)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# --------------------------------------------------------------------------- config


def test_config_defaults_keep_optional_backends_off():
    config = LoggerConfig()
    assert (config.jsonl, config.tensorboard, config.console) == (True, False, True)
    assert config.wandb is False and config.mlflow is False
    assert config.wandb_project == "opd" and config.wandb_mode == "online"
    assert config.mlflow_tracking_uri is None and config.mlflow_experiment == "opd"
    assert config.run_name is None


def test_config_rejects_unknown_wandb_mode_and_unknown_keys():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        LoggerConfig(wandb_mode="sometimes")
    with pytest.raises(ValidationError):
        LoggerConfig(wandb_projet="x")


def test_flatten_dict_uses_dotted_keys():
    assert flatten_dict({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}) == {
        "a.b": 1,
        "a.c.d": "x",
        "e": [1, 2],
        "f": {},
    }


# --------------------------------------------------------------------------- JSONL


def test_jsonl_record_written_and_flushed_per_call(tmp_path):
    logger = make_logger(tmp_path)
    path = tmp_path / "logs" / "metrics.jsonl"
    logger.log_metrics({"train/loss": 0.5, "train/kl_forward": 0.25, "perf/tokens_per_s": 1000}, step=1)
    # Read while the logger is still open: the record must already be on disk.
    records = read_lines(path)
    assert len(records) == 1
    assert records[0]["step"] == 1
    assert records[0]["train/loss"] == 0.5
    assert records[0]["train/kl_forward"] == 0.25
    assert records[0]["perf/tokens_per_s"] == 1000
    assert isinstance(records[0]["time"], float) and records[0]["time"] >= 0
    logger.log_metrics({"val/accuracy": 0.75}, step=1)
    logger.log_metrics({"train/loss": 0.4}, step=2)
    records = read_lines(path)
    assert [r["step"] for r in records] == [1, 1, 2]
    assert "train/loss" not in records[1] and records[1]["val/accuracy"] == 0.75
    assert records[2]["time"] >= records[0]["time"]
    logger.close()


def test_non_finite_floats_are_strings_and_every_line_is_valid_json(tmp_path):
    import torch

    logger = make_logger(tmp_path)
    logger.log_metrics(
        {"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/x": float("-inf"),
         "train/t": torch.tensor(0.5), "train/tag": "fixed"},
        step=3,
    )
    logger.close()
    text = (tmp_path / "logs" / "metrics.jsonl").read_text(encoding="utf-8")
    # json.loads accepts NaN/Infinity tokens, so check that the raw text has none.
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda token: pytest.fail(f"non-standard JSON constant {token}"))
    record = json.loads(text)
    assert record["train/loss"] == "nan"
    assert record["train/grad_norm"] == "inf"
    assert record["train/x"] == "-inf"
    assert record["train/t"] == 0.5  # a 0-d tensor is unwrapped to a number
    assert record["train/tag"] == "fixed"


def test_jsonl_off_writes_no_file(tmp_path):
    logger = make_logger(tmp_path, jsonl=False)
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.close()
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


def test_close_is_idempotent_and_appends_on_reopen(tmp_path):
    logger = make_logger(tmp_path)
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError):
        logger.log_metrics({"train/loss": 2.0}, step=2)
    again = make_logger(tmp_path)
    again.log_metrics({"train/loss": 2.0}, step=2)
    again.close()
    assert [r["step"] for r in read_lines(tmp_path / "logs" / "metrics.jsonl")] == [1, 2]


# --------------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_readable_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (opd[logging])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_logger(tmp_path, tensorboard=True)
    logger.log_hyperparams({"training": {"learning_rate": 1e-5}, "model": "tiny"})
    for step, loss in [(1, 2.0), (2, 1.5), (3, 1.25)]:
        logger.log_metrics({"train/loss": loss, "train/on_policy": 1, "train/tag": "skip-me"}, step=step)
    logger.log_metrics({"val/accuracy": 0.5}, step=3)
    logger.close()
    tb_dir = tmp_path / "logs" / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*")), "no event file written"
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "train/loss" in scalars and "val/accuracy" in scalars
    assert "train/tag" not in scalars  # non-numeric values are skipped
    events = accumulator.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([2.0, 1.5, 1.25])
    assert [e.value for e in accumulator.Scalars("val/accuracy")] == pytest.approx([0.5])
    assert any(tag.startswith("config") for tag in accumulator.Tags()["tensors"])


# --------------------------------------------------------------------------- resume


def test_truncate_after_keeps_steps_up_to_n_and_later_writes_append(tmp_path):
    first = make_logger(tmp_path)
    for step in range(1, 6):
        first.log_metrics({"train/loss": 1.0 / step}, step=step)
        if step % 2 == 0:
            first.log_metrics({"val/accuracy": step / 10}, step=step)
    first.close()
    path = tmp_path / "logs" / "metrics.jsonl"
    before = read_lines(path)
    assert [r["step"] for r in before] == [1, 2, 2, 3, 4, 4, 5]

    resumed = make_logger(tmp_path)
    resumed.truncate_after(2)
    kept = read_lines(path)
    assert [r["step"] for r in kept] == [1, 2, 2]
    assert kept == before[:3]  # kept records are unchanged
    assert not list(path.parent.glob("*.tmp")), "temporary file left behind"
    resumed.log_metrics({"train/loss": 0.3}, step=3)
    resumed.log_metrics({"train/loss": 0.2}, step=4)
    resumed.close()
    records = read_lines(path)
    assert [r["step"] for r in records] == [1, 2, 2, 3, 4]
    assert records[3]["train/loss"] == 0.3
    # "time" continues from the kept records rather than restarting at zero.
    assert records[3]["time"] >= kept[-1]["time"]


def test_truncate_after_purges_later_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (opd[logging])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = make_logger(tmp_path, tensorboard=True)
    for step in range(1, 6):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.close()
    resumed = make_logger(tmp_path, tensorboard=True)
    resumed.truncate_after(2)
    for step in (3, 4):
        resumed.log_metrics({"train/loss": 10.0 + step}, step=step)
    resumed.close()
    accumulator = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    accumulator.Reload()
    events = accumulator.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_truncate_after_without_file_is_a_no_op(tmp_path):
    logger = make_logger(tmp_path)
    (tmp_path / "logs" / "metrics.jsonl").unlink()
    logger.truncate_after(5)
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()
    logger.close()


# --------------------------------------------------------------------------- console


class FakeTerminal(io.StringIO):
    """A captured stdout that says it is a terminal, so the logger draws its tqdm bar into it."""

    def isatty(self) -> bool:
        return True


def fake_terminal(monkeypatch) -> FakeTerminal:
    """Replaces sys.stdout with a FakeTerminal (in the test body: pytest's capture resets sys.stdout
    after fixtures are set up)."""
    stream = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", stream)
    return stream


@pytest.fixture
def clock(monkeypatch) -> dict[str, float]:
    """The logger's time.perf_counter, advanced by hand."""
    now = {"now": 1000.0}
    monkeypatch.setattr("opd.run.logger.time.perf_counter", lambda: now["now"])
    return now


def bar_frames(out: str) -> list[str]:
    """Each drawing of the bar: tqdm redraws in place after a carriage return."""
    return [frame for line in out.split("\n") for frame in line.split("\r") if frame.startswith("step ")]


def frame_steps(frames: list[str], total: int) -> list[int]:
    return [int(match.group(1)) for frame in frames if (match := re.match(rf"step (\d+)/{total} ", frame))]


def line_steps(lines: list[str]) -> list[int]:
    return [int(re.match(r"step +(\d+)/", line).group(1)) for line in lines]


def test_console_line_format(tmp_path, capsys, clock):
    logger = make_logger(tmp_path, total_steps=50, console=True)
    clock["now"] += 6
    logger.log_metrics({"train/loss": 0.5, "train/kl_forward": 0.123456, "perf/tokens_per_s": 1234.5}, step=12)
    logger.log_metrics({"val/accuracy": 0.25, "val/kl_reverse": 0.5, "timing/validation": 3.0}, step=12,
                       console_keys=["val/accuracy", "val/kl_reverse", "val/missing"])
    logger.log_metrics({"timing/checkpoint": 0.5}, step=12, console_keys=[])  # no console line
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    train_line, val_line = lines
    # 6 s count as one step (the first record of the process): 38 steps left at 6 s each.
    assert train_line.startswith("step 12/50  24% 00:06<03:48,  6.00s/step, "), train_line
    assert "loss=0.5000" in train_line and "kl_forward=0.1235" in train_line
    assert "train/" not in train_line
    assert "perf/tokens_per_s=1234" in train_line  # other namespaces keep their prefix
    assert val_line.startswith("step 12/50  24% "), val_line
    assert "val/accuracy=0.2500" in val_line and "val/kl_reverse=0.5000" in val_line
    assert "timing/validation" not in val_line and "missing" not in val_line


def test_console_eta_uses_steps_logged_in_this_process(tmp_path, capsys, clock):
    # A run resumed at step 90 of 100; each step takes 10 s.
    logger = make_logger(tmp_path, total_steps=100, console=True)
    for step in (91, 92, 93):
        clock["now"] += 10
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    # Averaging over all 93 steps would give about 3 s/step; the real 10 s/step gives 01:10 for 7 left.
    assert lines[0].startswith("step  91/100  91% 00:10<01:30, 10.00s/step")  # first record: one step of 10 s
    assert lines[1].startswith("step  92/100  92% 00:20<01:20, 10.00s/step")
    assert lines[2].startswith("step  93/100  93% 00:30<01:10, 10.00s/step")


def test_console_eta_is_unknown_before_the_first_step(tmp_path, capsys, clock):
    logger = make_logger(tmp_path, total_steps=4, console=True)
    clock["now"] += 3
    logger.log_metrics({"val/accuracy": 0.5}, step=0, console_keys=["val/accuracy"])
    clock["now"] += 2
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.close()
    start, first = capsys.readouterr().out.splitlines()
    assert start.startswith("step 0/4   0% 00:03<?, ?step/s, val/accuracy=0.5000"), start
    assert first.startswith("step 1/4  25% 00:05<00:06,  2.00s/step, loss=1.0000"), first


def test_progress_bar_off_prints_one_plain_line_per_record_even_on_a_terminal(tmp_path, monkeypatch):
    """logger.progress_bar: false keeps the per-step lines: no bar, no carriage returns."""
    terminal = fake_terminal(monkeypatch)
    logger = make_logger(tmp_path, total_steps=10, console=True, progress_bar=False)
    for step in range(1, 11):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    logger.close()
    out = terminal.getvalue()
    assert "\r" not in out and "|" not in out
    lines = out.splitlines()
    assert line_steps(lines) == list(range(1, 11))
    assert lines[-1].startswith("step 10/10 100% ") and lines[-1].endswith("loss=0.1000")


def test_console_off_prints_nothing(tmp_path, monkeypatch, capsys):
    terminal = fake_terminal(monkeypatch)
    logger = make_logger(tmp_path, total_steps=10, console=False, progress_bar=True)
    for step in range(1, 11):
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.log_metrics({"val/accuracy": 0.5}, step=10, console_keys=["val/accuracy"])
    logger.close()
    assert terminal.getvalue() == ""
    assert capsys.readouterr().err == ""


def test_progress_bar_outside_a_terminal_prints_every_five_percent(tmp_path, capsys):
    """In a log file a carriage-return bar would be one endless line: a step line per 5% instead."""
    logger = make_logger(tmp_path, total_steps=100, console=True, progress_bar=True)
    for step in range(1, 101):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
        if step == 50:
            logger.log_metrics({"val/accuracy": 0.5}, step=50, console_keys=["val/accuracy"])
    logger.close()
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.splitlines()
    step_lines = [line for line in lines if "loss=" in line]
    assert line_steps(step_lines) == [1, *range(5, 101, 5)]  # the first step, then every 5%
    assert step_lines[1].startswith("step   5/100   5% ") and step_lines[1].endswith(", loss=0.2000")
    assert step_lines[-1].startswith("step 100/100 100% ") and step_lines[-1].endswith(", loss=0.0100")
    val_lines = [line for line in lines if "val/accuracy=0.5000" in line]  # validation always prints
    assert len(val_lines) == 1 and val_lines[0].startswith("step  50/100  50% ")
    assert len(lines) == len(step_lines) + 1


def test_progress_bar_outside_a_terminal_with_an_uneven_total(tmp_path, capsys):
    logger = make_logger(tmp_path, total_steps=7, console=True, progress_bar=True)
    for step in range(1, 8):
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.close()
    # Every step of a 7-step run passes another 5%: each gets its line.
    assert line_steps(capsys.readouterr().out.splitlines()) == list(range(1, 8))

    logger = make_logger(tmp_path, total_steps=1000, console=True, progress_bar=True)
    for step in range(1, 1000):  # a run stopped before its last step ends on its last 5% line
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.close()
    assert line_steps(capsys.readouterr().out.splitlines()) == [1, *range(50, 1000, 50)]


def test_progress_bar_outside_a_terminal_resumed_starts_at_the_resumed_step(tmp_path, capsys, clock):
    logger = make_logger(tmp_path, total_steps=100, console=True, progress_bar=True)
    logger.truncate_after(90)
    for step in range(91, 101):
        clock["now"] += 10
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert line_steps(lines) == [91, 95, 100]
    assert lines[1].startswith("step  95/100  95% 00:50<00:50, 10.00s/step")


def test_progress_bar_on_a_terminal_is_one_bar_with_the_latest_metrics(tmp_path, monkeypatch):
    terminal = fake_terminal(monkeypatch)
    logger = make_logger(tmp_path, total_steps=20, console=True, progress_bar=True)
    logger.log_metrics({"val/accuracy": 0.25}, step=0, console_keys=["val/accuracy"])
    for step in range(1, 21):
        logger.log_metrics({"train/loss": float(step), "perf/tokens_per_s": 100.0}, step=step,
                           console_keys=["train/loss", "perf/tokens_per_s"])
    logger.log_metrics({"val/accuracy": 0.75}, step=20, console_keys=["val/accuracy"])
    logger.close()
    out = terminal.getvalue()
    assert "\r" in out  # drawn in place
    # Validation results are written above the bar, each on a line of its own.
    assert "\nstep 0: val/accuracy=0.2500\n" in out.replace("\r", "\n")
    assert "\nstep 20: val/accuracy=0.7500\n" in out.replace("\r", "\n")
    frames = bar_frames(out)
    steps = frame_steps(frames, 20)
    assert steps[0] == 0 and steps[-1] == 20  # the bar starts at the validation's step 0
    assert steps == sorted(steps) and set(range(21)) <= set(steps)  # every step is drawn, in order
    final = frames[-1]
    assert re.match(r"step 20/20 100%\|#+\| \d\d:\d\d<00:00, +[\d.]+(step/s|s/step), ", final), final
    assert final.endswith(", loss=20.0000  perf/tokens_per_s=100")
    assert out.endswith("\n")  # close() leaves the final bar on its own line
    assert not [line for line in out.split("\n") if line.startswith("step 20/20 100% 0")]  # no plain lines


def test_progress_bar_on_a_terminal_resumed_starts_at_the_resumed_step(tmp_path, monkeypatch, clock):
    terminal = fake_terminal(monkeypatch)
    logger = make_logger(tmp_path, total_steps=100, console=True, progress_bar=True)
    logger.truncate_after(90)
    for step in range(91, 94):
        clock["now"] += 10
        logger.log_metrics({"train/loss": 1.0}, step=step)
    logger.close()
    frames = bar_frames(terminal.getvalue())
    steps = frame_steps(frames, 100)
    assert steps[0] == 90 and min(steps) == 90 and steps[-1] == 93
    # The ETA counts only the steps run by this process: 10 s each.
    assert [frame for frame in frames if frame.startswith("step 93/100  93%|")][-1].split("| ")[1].startswith(
        "00:30<01:10, 10.00s/step, loss=1.0000"
    )


@pytest.mark.parametrize("columns", [100, 0])
def test_progress_bar_on_a_real_pseudo_terminal(tmp_path, monkeypatch, columns):
    """A sized terminal gets the bar; one that reports zero columns (where tqdm draws nothing) gets lines."""
    pytest.importorskip("termios", reason="needs a POSIX pseudo-terminal")
    import fcntl
    import select
    import struct
    import termios

    main_fd, terminal_fd = os.openpty()
    try:
        with open(terminal_fd, "w", encoding="utf-8") as terminal:
            fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            monkeypatch.setattr(sys, "stdout", terminal)
            # Few steps: the pseudo-terminal holds only a few KB until it is read below.
            logger = make_logger(tmp_path, total_steps=20, console=True, progress_bar=True)
            for step in range(1, 21):
                logger.log_metrics({"train/loss": 1.0}, step=step)
            logger.close()
            terminal.flush()
            monkeypatch.undo()  # sys.stdout is pytest's again before this stream is closed
            chunks = []
            while select.select([main_fd], [], [], 0.5)[0]:
                chunks.append(os.read(main_fd, 65536))
    finally:
        os.close(main_fd)
    out = b"".join(chunks).decode("utf-8").replace("\r\n", "\n")  # the terminal turns \n into \r\n
    if columns:
        frames = bar_frames(out)
        assert "\r" in out and frame_steps(frames, 20)[-1] == 20
        assert len(frames[-1]) <= columns and frames[-1].endswith(", loss=1.0000")
    else:
        assert "\r" not in out
        assert line_steps(out.splitlines()) == list(range(1, 21))  # each step of 20 is another 5%


def test_progress_bar_routes_opd_log_messages_above_the_bar(tmp_path, monkeypatch):
    """A warning while the bar is drawn clears the bar, prints, and redraws it (tqdm.write)."""
    terminal = fake_terminal(monkeypatch)
    errors = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", errors)
    opd_log = logging.getLogger("opd")
    handler = logging.StreamHandler(sys.stderr)
    monkeypatch.setattr(opd_log, "handlers", [handler])
    monkeypatch.setattr(opd_log, "propagate", False)
    logger = make_logger(tmp_path, total_steps=10, console=True, progress_bar=True)
    logger.log_metrics({"train/loss": 1.0}, step=1)
    drawn = len(frame_steps(bar_frames(terminal.getvalue()), 10))
    opd_log.warning("checkpoint written")
    assert "checkpoint written\n" in errors.getvalue()
    assert len(frame_steps(bar_frames(terminal.getvalue()), 10)) == drawn + 1  # redrawn below the message
    logger.close()
    assert opd_log.handlers == [handler]  # the console handler is back once the bar is gone


# --------------------------------------------------------------------------- optional backends


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_optional_backend_is_a_config_error(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # makes `import backend` fail
    with pytest.raises(ConfigError) as error:
        make_logger(tmp_path, **{backend: True})
    assert str(error.value) == f"logger.{backend} is on but {backend} is not installed: pip install 'opd[{backend}]'"
    assert not (tmp_path / "logs").exists()  # checked before anything was created


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'opd[wandb]')")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make_logger(tmp_path, wandb=True, wandb_mode="offline", wandb_project="opd-test", run_name="unit")
    run = logger._wandb_run
    assert run is not None
    logger.log_hyperparams({"training": {"learning_rate": 1e-5, "batch_size": 4}, "tags": ["a", "b"]})
    logger.log_metrics({"train/loss": 2.0, "train/tag": "not-a-number"}, step=1)
    logger.log_metrics({"train/loss": 1.5}, step=2)
    logger.log_metrics({"val/accuracy": 0.5}, step=2)
    logger.log_metrics({"train/loss": 1.25}, step=3)  # W&B commits step 2's row once a later step arrives
    assert run.summary["_step"] >= 2
    assert run.summary["train/loss"] == 1.5
    assert run.summary["val/accuracy"] == 0.5
    assert "train/tag" not in dict(run.summary)
    assert run.config["training.learning_rate"] == 1e-5
    assert run.config["training.batch_size"] == 4
    assert run.name == "unit"
    logger.close()
    logger.close()
    offline_runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, "W&B offline run not written under log_dir"
    assert list(offline_runs[0].glob("run-*.wandb"))


def test_mlflow_file_store_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'opd[mlflow]')")
    # The logger opts in to MLflow 3's file store via this variable; undo that after the test.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow import MlflowClient

    logger = make_logger(tmp_path, mlflow=True, mlflow_experiment="opd-test", run_name="unit")
    assert logger.mlflow_tracking_uri.startswith("file:")
    assert logger.mlflow_tracking_uri.endswith("/logs/mlruns")
    run_id = logger._mlflow_run_id
    long_value = "x" * 10_000
    logger.log_hyperparams({"training": {"learning_rate": 1e-5}, "notes": long_value})
    logger.log_metrics({"train/loss": 2.0, "train/tag": "skip"}, step=1)
    logger.log_metrics({"train/loss": float("nan")}, step=2)
    logger.log_metrics({"train/loss": 1.0, "val/accuracy": 0.5}, step=3)
    logger.close()
    logger.close()
    assert (tmp_path / "logs" / "mlruns").is_dir()

    client = MlflowClient(tracking_uri=(tmp_path / "logs" / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "unit"
    assert client.get_experiment(run.info.experiment_id).name == "opd-test"
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert history[0].value == 2.0 and math.isnan(history[1].value) and history[2].value == 1.0
    assert "train/tag" not in run.data.metrics
    assert run.data.params["training.learning_rate"] == "1e-05"
    assert 0 < len(run.data.params["notes"]) < len(long_value)  # truncated to MLflow's limit


def test_mlflow_explicit_tracking_uri(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'opd[mlflow]')")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "elsewhere"
    logger = make_logger(tmp_path, mlflow=True, mlflow_tracking_uri=store.as_uri())
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.close()
    assert store.is_dir() and not (tmp_path / "logs" / "mlruns").exists()
