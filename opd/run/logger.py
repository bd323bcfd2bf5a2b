"""Run logging: console progress, per-step JSONL, TensorBoard, W&B and MLflow.

Metric names are ``train/*``, ``val/*``, ``timing/*`` (seconds per phase) and ``perf/*`` (throughput, memory).
Every backend gets the same flat dictionary per record: ``<log_dir>/metrics.jsonl`` one flushed
``{"step": N, "time": seconds, ...}`` object, TensorBoard / W&B / MLflow its numeric values, the console one line
(or, with ``logger.progress_bar``, a tqdm bar on a terminal and a line every 5% elsewhere).
A switched-on backend whose package is missing is a ConfigError when the :class:`Logger` is built.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import Field
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError, first_line

log = logging.getLogger("opd")

METRICS_FILENAME = "metrics.jsonl"

# progress_bar mode outside a terminal: a step line every 1/20 (5%) of the run.
_PLAIN_LINES_PER_RUN = 20
# Shared by the terminal bar and the plain lines.
_BAR_FORMAT = "step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}, {rate_fmt}{postfix}"


class LoggerConfig(StrictConfig):
    """Where and how metrics are written."""

    log_dir: str = Field("logs", description="directory for metrics.jsonl, TensorBoard, W&B and MLflow files")
    jsonl: bool = Field(True, description="write <log_dir>/metrics.jsonl, one JSON record per step")
    tensorboard: bool = Field(False, description="write TensorBoard event files to <log_dir>/tensorboard")
    console: bool = Field(True, description="print one progress line per step")
    progress_bar: bool = Field(
        False,
        description="on a terminal, replace the per-step lines with one in-place progress bar showing the "
        "latest step's metrics (validation results still print); elsewhere (CI logs, files) print a step "
        "line every 5% of the run (and at its first and last step) instead",
    )
    wandb: bool = Field(False, description="log to Weights & Biases (pip install 'opd[wandb]')")
    wandb_project: str = Field("opd", description="W&B project name")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="W&B mode; 'offline' keeps the run under <log_dir>/wandb for a later `wandb sync`"
    )
    mlflow: bool = Field(False, description="log to MLflow (pip install 'opd[mlflow]')")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; None means a file store in <log_dir>/mlruns"
    )
    mlflow_experiment: str = Field("opd", description="MLflow experiment name (created if missing)")
    run_name: str | None = Field(None, description="run name shown by W&B and MLflow; None lets them choose")


def setup_console_logging(level: int = logging.INFO) -> None:
    """Routes opd's ``logging`` messages to stderr with a short prefix."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[opd] %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:.0f}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4f}"
    return str(value)


def _as_scalar(value: Any) -> float | int | None:
    """The value as a Python number (single-element arrays/tensors unwrapped), or None; booleans are not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and (getattr(value, "ndim", None) == 0 or tuple(getattr(value, "shape", ())) == (1,)):
        try:
            return _as_scalar(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _json_value(value: Any) -> Any:
    """A JSON-safe form of one metric value (non-finite floats become strings)."""
    scalar = _as_scalar(value)
    if scalar is not None:
        value = scalar
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": keeps every line valid JSON
    return value


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and other leaves are kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_dict(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


class Logger:
    """Fans metrics out to the enabled backends; ``total_steps`` drives the console's progress and ETA.

    Raises:
        ConfigError: a backend's package is missing, or the W&B / MLflow run cannot be started.
    """

    def __init__(self, config: LoggerConfig, total_steps: int) -> None:
        self.config = config
        self.total_steps = total_steps
        self.log_dir = Path(config.log_dir)
        # Imported before anything is created, so a missing package leaves nothing open.
        wandb_module = _import_optional("wandb") if config.wandb else None
        mlflow_module = _import_optional("mlflow") if config.mlflow else None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_time = time.perf_counter()
        # Seconds spent before a resume (truncate_after), so the JSONL "time" keeps growing.
        self._time_offset = 0.0
        # The ETA averages over the steps after this process's first one.
        self._first_step: int | None = None
        self._first_step_time = 0.0
        self._records_written = 0
        self._closed = False
        self._bar: _RunBar | None = None  # progress_bar mode on a terminal; made by the first console record
        self._bar_logging = ExitStack()  # routes opd's console log messages above the bar while it is drawn
        self._on_terminal: bool | None = None  # progress_bar mode: decided on the first console record
        self._last_line_mark: int | None = None  # progress_bar mode outside a terminal: 5% mark of the last line
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8") if config.jsonl else None  # noqa: SIM115 - open for the whole run
        self._tensorboard: Any = None
        self._tensorboard_writer_cls: Any = None
        self._wandb_run: Any = None
        self._mlflow_client: Any = None
        self._mlflow_run_id: str | None = None
        try:
            if config.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:  # tensorboard is an optional extra
                    log.warning("logger.tensorboard is on but tensorboard is not installed; pip install 'opd[logging]'")
                else:
                    self._tensorboard_writer_cls = SummaryWriter
                    self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir))
            if wandb_module is not None:
                self._start_wandb(wandb_module)
            if mlflow_module is not None:
                self._start_mlflow()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ paths

    @property
    def metrics_path(self) -> Path:
        """``<log_dir>/metrics.jsonl``."""
        return self.log_dir / METRICS_FILENAME

    @property
    def tensorboard_dir(self) -> Path:
        return self.log_dir / "tensorboard"

    @property
    def mlflow_tracking_uri(self) -> str:
        """The configured MLflow URI, or a file store in ``<log_dir>/mlruns``."""
        if self.config.mlflow_tracking_uri:
            return self.config.mlflow_tracking_uri
        return (self.log_dir.resolve() / "mlruns").as_uri()

    # ------------------------------------------------------------------ optional backends

    def _start_wandb(self, wandb: Any) -> None:
        try:
            self._wandb_run = wandb.init(
                project=self.config.wandb_project,
                name=self.config.run_name,
                dir=str(self.log_dir),
                mode=self.config.wandb_mode,
            )
        except Exception as error:  # wandb raises its own types (no API key, bad project, ...)
            raise ConfigError(
                f"logger.wandb: could not start a W&B run ({first_line(error)}); "
                "log in with `wandb login`, set WANDB_API_KEY, or use logger.wandb_mode=offline"
            ) from None

    def _start_mlflow(self) -> None:
        uri = self.mlflow_tracking_uri
        if uri.startswith("file:"):
            # MLflow 3 refuses the file store unless asked for it; this default wants one beside metrics.jsonl.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        try:
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(self.config.mlflow_experiment)
            if experiment is None:
                experiment_id = client.create_experiment(self.config.mlflow_experiment)
            else:
                experiment_id = experiment.experiment_id
            run = client.create_run(experiment_id, run_name=self.config.run_name)
        except Exception as error:  # MlflowException, connection errors, ...
            raise ConfigError(
                f"logger.mlflow: could not start an MLflow run at {uri!r} ({first_line(error)})"
            ) from None
        self._mlflow_client = client
        self._mlflow_run_id = run.info.run_id

    # ------------------------------------------------------------------ logging

    def log_metrics(self, metrics: dict[str, Any], step: int, console_keys: list[str] | None = None) -> None:
        """Writes one record of flat ``metrics`` for ``step`` to every backend.

        Non-numbers go to JSONL and the console only; non-finite floats become strings in JSONL.
        ``console_keys`` picks what the console shows (None: all); when none is present, no line is printed.
        """
        if self._closed:
            raise RuntimeError("Logger.log_metrics called after close()")
        now = time.perf_counter()
        if self._first_step is None:
            self._first_step, self._first_step_time = step, now
        if self._jsonl is not None:
            record: dict[str, Any] = {"step": step, "time": round(self._time_offset + now - self.start_time, 3)}
            for key, value in metrics.items():
                record[key] = _json_value(value)
            self._jsonl.write(json.dumps(record, default=str) + "\n")
            self._jsonl.flush()
        self._records_written += 1
        scalars = {key: scalar for key, value in metrics.items() if (scalar := _as_scalar(value)) is not None}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb_run is not None and scalars:
            self._wandb_run.log(scalars, step=step)
        if self._mlflow_client is not None and scalars:
            self._mlflow_log_metrics(scalars, step)
        if self.config.console:
            keys = console_keys if console_keys is not None else list(metrics)
            # The console drops the train/ prefix only.
            shown = "  ".join(
                f"{key.removeprefix('train/')}={_format_value(metrics[key])}" for key in keys if key in metrics
            )
            if shown or console_keys is None:
                self._console(step, now, shown, is_step_record=any(k.startswith("train/") for k in metrics))

    def _console(self, step: int, now: float, shown: str, is_step_record: bool) -> None:
        """Shows one record as a plain line or (progress_bar mode) on the bar; non-step records always print."""
        if not self.config.progress_bar:
            print(self._line(step, now, shown), flush=True)
            return
        if self._on_terminal is None:
            # Decided once: a run never mixes the bar with plain lines.
            self._on_terminal = _is_terminal(sys.stdout)
        if not self._on_terminal:
            # A bar would be one endless line in a log file.
            if not is_step_record or self._passes_line_mark(step):
                print(self._line(step, now, shown), flush=True)
            return
        timing = self._timing(step, now)
        bar = self._bar
        if bar is None:  # not `self._bar or ...`: a tqdm bar of total 0 is falsy
            # A resumed run's bar starts at the checkpoint.
            bar = self._open_bar(initial=step - 1 if is_step_record else step, timing=timing)
        bar.timing = timing
        if is_step_record:
            # Set, not update()d: each record draws the bar exactly once, whatever tqdm's redraw interval.
            bar.n = step
            bar.set_postfix_str(shown, refresh=True)
        else:
            bar.write(f"step {step}: {shown}", file=sys.stdout)

    def _open_bar(self, initial: int, timing: tuple[float, float]) -> _RunBar:
        """Draws the progress_bar-mode bar on the terminal at step ``initial``."""
        self._bar = _RunBar(
            total=self.total_steps,
            initial=initial,
            timing=timing,
            unit="step",
            bar_format=_BAR_FORMAT,
            dynamic_ncols=True,
            file=sys.stdout,
        )
        if any(_is_console_handler(handler) for handler in log.handlers):
            # opd's log messages are written above the bar instead of into its line.
            self._bar_logging.enter_context(logging_redirect_tqdm(loggers=[log], tqdm_class=_RunBar))
        return self._bar

    def _timing(self, step: int, now: float) -> tuple[float, float]:
        """Elapsed seconds since this logger started, and steps per second (0 when unknown).

        The rate counts only this process's steps, so a resumed run's ETA is not flattered by the steps it skipped.
        """
        elapsed = now - self.start_time
        if self._first_step is not None and step > self._first_step and now > self._first_step_time:
            return elapsed, (step - self._first_step) / (now - self._first_step_time)
        if step > 0 and elapsed > 0:
            # This process's first record comes after one step of work.
            return elapsed, 1.0 / elapsed
        return elapsed, 0.0

    def _line(self, step: int, now: float, shown: str) -> str:
        """``step 12/50  24% 01:02<03:17,  5.19s/step, loss=0.5000``: one plain console line."""
        elapsed, rate = self._timing(step, now)
        # Padded to the total's width so that lines align.
        line_format = _BAR_FORMAT.replace("{n_fmt}", f"{{n_fmt:>{len(str(self.total_steps))}}}")
        line_format = line_format.replace("|{bar}|", "")
        return tqdm.format_meter(
            step, self.total_steps, elapsed, rate=rate, unit="step", bar_format=line_format, postfix=shown or None
        )

    def _passes_line_mark(self, step: int) -> bool:
        """Whether a step record gets a line outside a terminal: this process's first, the last, or a new 5% mark."""
        mark = step * _PLAIN_LINES_PER_RUN // max(self.total_steps, 1)
        if mark == self._last_line_mark and step < self.total_steps:  # the first step finds None here
            return False
        self._last_line_mark = mark
        return True

    def _mlflow_log_metrics(self, scalars: dict[str, float | int], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        entries = [Metric(key, float(value), timestamp, step) for key, value in scalars.items()]
        batch = _mlflow_limit("MAX_METRICS_PER_BATCH", 1000)
        for start in range(0, len(entries), batch):
            self._mlflow_client.log_batch(self._mlflow_run_id, metrics=entries[start : start + batch])

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Records the run config as dotted keys with W&B, MLflow (values cut to its limits) and TensorBoard."""
        if self._closed:
            raise RuntimeError("Logger.log_hyperparams called after close()")
        flat = flatten_dict(params)
        if not flat:
            return
        if self._wandb_run is not None:
            self._wandb_run.config.update(flat, allow_val_change=True)
        if self._mlflow_client is not None:
            from mlflow.entities import Param

            max_key = _mlflow_limit("MAX_ENTITY_KEY_LENGTH", 250)
            max_value = _mlflow_limit("MAX_PARAM_VAL_LENGTH", 500)
            entries = [Param(key[:max_key], _param_text(value)[:max_value]) for key, value in flat.items()]
            batch = _mlflow_limit("MAX_PARAMS_TAGS_PER_BATCH", 100)
            for start in range(0, len(entries), batch):
                self._mlflow_client.log_batch(self._mlflow_run_id, params=entries[start : start + batch])
        if self._tensorboard is not None:
            rows = "\n".join(f"| {key} | {_param_text(value).replace('|', '&#124;')} |" for key, value in flat.items())
            self._tensorboard.add_text("config", f"| key | value |\n|---|---|\n{rows}", 0)
            self._tensorboard.flush()

    # ------------------------------------------------------------------ resume

    def truncate_after(self, step: int) -> None:
        """For a resume from ``step``: drops later records from ``metrics.jsonl`` and TensorBoard. Call before logging.

        The file is replaced atomically; the JSONL ``time`` continues from the last kept record.
        """
        if self._closed:
            raise RuntimeError("Logger.truncate_after called after close()")
        if self._records_written:
            log.warning("Logger.truncate_after(%d) called after records were written by this run", step)
        if self._tensorboard is not None and self._records_written == 0:
            self._tensorboard.close()
            self._tensorboard = self._tensorboard_writer_cls(log_dir=str(self.tensorboard_dir), purge_step=step + 1)
        path = self.metrics_path
        if not path.is_file():
            return
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        kept: list[str] = []
        last_time = 0.0
        with open(path, encoding="utf-8") as source:
            for line in source:
                text = line.strip()
                if not text:
                    continue
                try:
                    record = json.loads(text)
                    record_step = int(record["step"])
                except (ValueError, TypeError, KeyError):
                    log.warning("dropping a malformed line of %s while truncating", path)
                    continue
                if record_step <= step:
                    kept.append(text)
                    record_time = record.get("time")
                    if isinstance(record_time, (int, float)) and not isinstance(record_time, bool):
                        last_time = max(last_time, float(record_time))
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temporary, "w", encoding="utf-8") as target:
            target.write("".join(f"{text}\n" for text in kept))
            target.flush()
            os.fsync(target.fileno())
        os.replace(temporary, path)
        self._time_offset = last_time
        if self.config.jsonl:
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Flushes and closes every backend and ends the W&B and MLflow runs; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._bar_logging.close()  # opd's own console handler is back
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            try:
                run.finish()
            except Exception as error:  # never lose the run's other outputs to a W&B hiccup
                log.warning("could not finish the W&B run: %s", first_line(error))
        if self._mlflow_client is not None:
            client, self._mlflow_client = self._mlflow_client, None
            try:
                client.set_terminated(self._mlflow_run_id, status="FINISHED")
            except Exception as error:
                log.warning("could not end the MLflow run: %s", first_line(error))


def _import_optional(module_name: str) -> Any:
    """Imports an optional backend package or raises the install hint (its extra has its name) as a ConfigError."""
    try:
        return __import__(module_name)
    except ImportError:
        raise ConfigError(
            f"logger.{module_name} is on but {module_name} is not installed: pip install 'opd[{module_name}]'"
        ) from None


def _mlflow_limit(name: str, default: int) -> int:
    """One of MLflow's validation limits, with a fallback for versions that lack it."""
    try:
        from mlflow.utils import validation
    except ImportError:
        return default
    value = getattr(validation, name, default)
    return value if isinstance(value, int) and value > 0 else default


def _param_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def _is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal that can show a bar (not one of zero columns, as ``script`` makes in CI)."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # no isatty(), or a closed stream
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor (an in-memory stream): trust isatty()
        return True


def _is_console_handler(handler: logging.Handler) -> bool:
    """A logging handler that writes to the console (stdout or stderr), not to a file."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class _RunBar(tqdm):
    """The progress bar, showing :meth:`Logger._timing` (tqdm's own would count a resume's jump as instant work).

    ``timing`` is (elapsed seconds, steps per second or 0), reassigned before each redraw.
    """

    def __init__(self, *args: Any, timing: tuple[float, float], **kwargs: Any) -> None:
        self.timing = timing  # set first: tqdm draws the bar from its constructor
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's display fields with the Logger's elapsed time and rate."""
        values = super().format_dict
        values["elapsed"], values["rate"] = self.timing
        return values
