"""Run logging: console progress, per-step JSONL, TensorBoard, W&B and MLflow.

Metric names are namespaced: ``train/*`` (loss, KL, grad norm, ...), ``val/*``,
``timing/*`` (seconds per phase) and ``perf/*`` (throughput, memory). Every backend
receives the same flat dictionary for a step:

* ``<log_dir>/metrics.jsonl`` gets one JSON object per call,
  ``{"step": N, "time": seconds, "<metric>": value, ...}``, flushed at once;
* TensorBoard (``logger.tensorboard``), Weights & Biases (``logger.wandb``) and MLflow
  (``logger.mlflow``) get the numeric values as scalars (anything else is skipped);
* the console gets one progress line per call.

The optional backends are imported only when switched on; a missing package is a
:class:`~opd.utils.errors.ConfigError` raised when the :class:`Logger` is built, before
any model is loaded.
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
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError

log = logging.getLogger("opd")

METRICS_FILENAME = "metrics.jsonl"


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
        "line every 5% of the run instead",
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
    """The value as a Python number for scalar backends, or None when it is not one.

    Booleans are not scalars here; NumPy / PyTorch single-element values are unwrapped.
    """
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
    """Fans metrics out to the enabled backends.

    Args:
        config: the ``logger`` config section.
        total_steps: planned optimizer steps (for the console's progress and ETA).

    Raises:
        ConfigError: a backend is switched on but its package is missing, or the W&B /
            MLflow run cannot be started.
    """

    def __init__(self, config: LoggerConfig, total_steps: int) -> None:
        self.config = config
        self.total_steps = total_steps
        self.log_dir = Path(config.log_dir)
        # Check the optional packages before anything is created, so a missing one leaves nothing open.
        wandb_module = _import_optional("wandb", "wandb") if config.wandb else None
        mlflow_module = _import_optional("mlflow", "mlflow") if config.mlflow else None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_time = time.perf_counter()
        # Seconds already spent by earlier processes of a resumed run (set by truncate_after),
        # so the JSONL "time" keeps growing across a resume.
        self._time_offset = 0.0
        # The first step logged by this process and when: the ETA averages over later steps only.
        self._first_step: int | None = None
        self._first_step_time = 0.0
        self._records_written = 0
        self._closed = False
        self._bar: Any = None  # the tqdm bar of progress_bar mode, created on the first step record
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8") if config.jsonl else None
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
                    log.warning(
                        "logger.tensorboard is on but tensorboard is not installed; pip install 'opd[logging]'"
                    )
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
                f"logger.wandb: could not start a W&B run ({_first_line(error)}); "
                "log in with `wandb login`, set WANDB_API_KEY, or use logger.wandb_mode=offline"
            ) from None

    def _start_mlflow(self) -> None:
        uri = self.mlflow_tracking_uri
        if uri.startswith("file:"):
            # MLflow 3 refuses the file store unless asked for it; a local directory next to
            # metrics.jsonl is the point of this default.
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
                f"logger.mlflow: could not start an MLflow run at {uri!r} ({_first_line(error)})"
            ) from None
        self._mlflow_client = client
        self._mlflow_run_id = run.info.run_id

    # ------------------------------------------------------------------ logging

    def log_metrics(self, metrics: dict[str, Any], step: int, console_keys: list[str] | None = None) -> None:
        """Writes one record of metrics for ``step`` to every backend.

        Args:
            metrics: flat ``{"train/loss": 0.5, ...}``; non-finite floats are kept as
                strings in JSONL so the file stays valid JSON. Values that are not numbers
                go to JSONL and the console only.
            step: optimizer step the metrics belong to.
            console_keys: subset printed on the console (all when None); when none of
                them is in ``metrics`` no console line is printed for this record.
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
            # train/ is the default namespace on the console; val/, timing/, perf/ stay visible.
            shown = "  ".join(
                f"{key.removeprefix('train/')}={_format_value(metrics[key])}" for key in keys if key in metrics
            )
            # An explicitly empty selection (e.g. a checkpoint's timing) prints no line at all.
            if shown or console_keys is None:
                self._print_progress(step, now, shown, is_step_record=any(k.startswith("train/") for k in metrics))

    def _print_progress(self, step: int, now: float, shown: str, is_step_record: bool) -> None:
        """Prints one console record: a line, or (progress_bar mode) an update of the bar."""
        if not self.config.progress_bar:
            print(f"{self._progress(step, now)} {shown}".rstrip(), flush=True)
            return
        if not sys.stdout.isatty():
            # A carriage-return bar turns into one endless line in a log file: print every 5%.
            every = max(self.total_steps // 20, 1)
            if not is_step_record or step % every == 0 or step >= self.total_steps:
                print(f"{self._progress(step, now)} {shown}".rstrip(), flush=True)
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_steps, initial=step if not is_step_record else step - 1,
                             desc="steps", dynamic_ncols=True, file=sys.stdout)
        if is_step_record:
            self._bar.update(max(step - self._bar.n, 0))
            self._bar.set_postfix_str(shown, refresh=True)
        else:
            self._bar.write(f"step {step}: {shown}")

    def _mlflow_log_metrics(self, scalars: dict[str, float | int], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        entries = [Metric(key, float(value), timestamp, step) for key, value in scalars.items()]
        batch = _mlflow_limit("MAX_METRICS_PER_BATCH", 1000)
        for start in range(0, len(entries), batch):
            self._mlflow_client.log_batch(self._mlflow_run_id, metrics=entries[start : start + batch])

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Records the resolved run config with every backend that keeps hyperparameters.

        Nested sections are flattened to dotted keys (``training.learning_rate``). W&B gets
        them as its run config, MLflow as params (values cut to MLflow's length limit), and
        TensorBoard as a ``config`` text table. JSONL and the console are left alone.

        Args:
            params: the config tree (a dict, or a pydantic model, which is dumped first).
        """
        if self._closed:
            raise RuntimeError("Logger.log_hyperparams called after close()")
        if hasattr(params, "model_dump"):
            params = params.model_dump(mode="json", by_alias=True)  # type: ignore[union-attr]
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
            rows = "\n".join(
                f"| {key} | {_param_text(value).replace('|', '&#124;')} |" for key, value in flat.items()
            )
            self._tensorboard.add_text("config", f"| key | value |\n|---|---|\n{rows}", 0)
            self._tensorboard.flush()

    # ------------------------------------------------------------------ resume

    def truncate_after(self, step: int) -> None:
        """Drops the records of steps after ``step`` from ``metrics.jsonl`` (for a resume).

        A run resumed from checkpoint ``step`` repeats the steps after it; without this the
        file would hold them twice. The file is rewritten through a temporary file and
        ``os.replace``, so a crash leaves either the old or the new file. Call it before
        this logger writes any record. TensorBoard is restarted to purge its later events,
        and the JSONL ``time`` continues from the last kept record. No-op without the file.
        """
        if self._closed:
            raise RuntimeError("Logger.truncate_after called after close()")
        if self._records_written:
            log.warning("Logger.truncate_after(%d) called after records were written by this run", step)
        if self._tensorboard is not None and self._records_written == 0:
            # A fresh writer with purge_step hides the old events of steps > step.
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
            self._jsonl = open(path, "a", encoding="utf-8")

    # ------------------------------------------------------------------ console

    def _progress(self, step: int, now: float | None = None) -> str:
        """``step 12/50 [####----------------] 01:02<04:05``: position, bar, elapsed and ETA.

        Elapsed time counts from this logger's start. The ETA multiplies the remaining steps
        by the mean time per step logged by this process (from its first logged step), so a
        resumed run is not credited with the steps it skipped; ``--:--`` until it is known.
        """
        now = time.perf_counter() if now is None else now
        elapsed = now - self.start_time
        total = self.total_steps
        fraction = min(max(step / total, 0.0), 1.0) if total > 0 else 0.0
        width = 20
        filled = int(fraction * width)
        bar = "#" * filled + "-" * (width - filled)
        remaining = max(total - step, 0)
        if self._first_step is not None and step > self._first_step:
            eta = (now - self._first_step_time) / (step - self._first_step) * remaining
            eta_text = _clock(eta)
        elif remaining == 0:
            eta_text = _clock(0.0)
        elif step > 0:
            # The first record of this process comes after one step of work since the start.
            eta_text = _clock(elapsed * remaining)
        else:
            eta_text = "--:--"
        return f"step {step:>{len(str(total))}}/{total} [{bar}] {_clock(elapsed)}<{eta_text}"

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Flushes and closes every backend: finishes the W&B run and ends the MLflow run.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
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
                log.warning("could not finish the W&B run: %s", _first_line(error))
        if self._mlflow_client is not None:
            client, self._mlflow_client = self._mlflow_client, None
            try:
                client.set_terminated(self._mlflow_run_id, status="FINISHED")
            except Exception as error:
                log.warning("could not end the MLflow run: %s", _first_line(error))

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _import_optional(module_name: str, extra: str) -> Any:
    """Imports an optional backend package or raises the install hint as a ConfigError."""
    try:
        return __import__(module_name)
    except ImportError:
        raise ConfigError(
            f"logger.{module_name} is on but {module_name} is not installed: pip install 'opd[{extra}]'"
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def is_main_process() -> bool:
    """True on the process that owns logging (rank 0 when launched distributed)."""
    return os.environ.get("RANK", "0") == "0"
