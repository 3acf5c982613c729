"""Spark ML Params declared once from tables, with generated getters, setters and constructors."""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import numpy as np
from pyspark.ml.param import Param, Params

from spark_hvd.spark.estimator.outputs import TASKS

__all__ = [
    "ParamSpec",
    "params_mixin",
    "ESTIMATOR_PARAMS",
    "HOROVOD_ESTIMATOR_PARAMS",
    "MODEL_PARAMS",
    "EstimatorParams",
    "ModelParams",
    "Converter",
    "AnyValue",
    "ToInt",
    "ToFloat",
    "ToBool",
    "ToString",
    "ToStringList",
    "ToFloatList",
    "ToList",
    "History",
    "ToHistory",
    "ToChoice",
    "ToCallable",
    "ToValidation",
    "ToShapes",
    "ToStore",
]


# ---- type converters ------------------------------------------------------------------------
# Classes rather than closures: Param objects keep their converter, and Params must pickle with
# the standard pickle (CrossValidator and ML persistence copy and ship estimators).


class Converter:
    """Checks and normalizes a Param value; raises ValueError naming the Param, value and fix."""

    expected = "a value"
    example = ""

    def __init__(self) -> None:
        self.name = "param"

    def bind(self, name: str) -> "Converter":
        """Attach the Param name used in error messages."""
        self.name = name
        return self

    def fail(self, value: Any) -> ValueError:
        """The error for an invalid ``value``."""
        fix = f"; pass e.g. {self.name}={self.example}" if self.example else ""
        return ValueError(f"{self.name}={value!r} is not valid: expected {self.expected}{fix}")

    def __call__(self, value: Any) -> Any:
        return value


class AnyValue(Converter):
    """Accepts any object (models, optimizers, callables, ...) unchanged."""

    expected = "any object"


class ToInt(Converter):
    """An integer, optionally bounded below; integral floats are accepted, bools are not."""

    def __init__(self, minimum: Optional[int] = None) -> None:
        super().__init__()
        self.minimum = minimum
        self.expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        self.example = str(max(minimum or 0, 1) if minimum is not None else 42)

    def __call__(self, value: Any) -> int:
        if isinstance(value, bool):
            raise self.fail(value)
        if isinstance(value, numbers.Integral):
            result = int(value)
        elif isinstance(value, numbers.Real) and float(value).is_integer():
            result = int(value)
        else:
            raise self.fail(value)
        if self.minimum is not None and result < self.minimum:
            raise self.fail(value)
        return result


class ToFloat(Converter):
    """A real number, optionally finite and bounded below."""

    def __init__(self, minimum: Optional[float] = None, example: str = "0.5") -> None:
        super().__init__()
        self.minimum = minimum
        self.expected = "a number" if minimum is None else f"a finite number >= {minimum:g}"
        self.example = example

    def __call__(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.fail(value)
        result = float(value)
        if self.minimum is not None and not (np.isfinite(result) and result >= self.minimum):
            raise self.fail(value)
        return result


class ToBool(Converter):
    """True or False (numpy booleans included); strings and numbers are refused."""

    expected = "True or False"
    example = "True"

    def __call__(self, value: Any) -> bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise self.fail(value)


class ToBoolOrAuto(Converter):
    """True, False or 'auto' (decided where it is used)."""

    expected = "True, False or 'auto'"
    example = "'auto'"

    def __call__(self, value: Any) -> Any:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if value == "auto":
            return "auto"
        raise self.fail(value)


class ToString(Converter):
    """A non-empty string."""

    expected = "a non-empty string"
    example = "'name'"

    def __call__(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(value)
        return value


class ToStringList(Converter):
    """A list of non-empty strings; one string becomes a one-element list."""

    expected = "a list of column names"
    example = "['features']"

    def __call__(self, value: Any) -> List[str]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise self.fail(value)
        if not all(isinstance(v, str) and v for v in items):
            raise self.fail(value)
        return list(items)


class ToFloatList(Converter):
    """A list of numbers."""

    expected = "a list of numbers"
    example = "[1.0, 0.5]"

    def __call__(self, value: Any) -> List[float]:
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(value)
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
            raise self.fail(value)
        return [float(v) for v in value]


class History(list):
    """A fit's per-epoch metrics: a list of dicts (``history[-1]["val_loss"]``) that also reads as
    Horovod's dict of metric lists (``history["val_loss"]``, ``history.keys()``)."""

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, str):
            return super().__getitem__(key)
        values = [row[key] for row in self if key in row]
        if not values:
            raise KeyError(f"{key!r} is not a metric of this history: expected one of {sorted(self.keys())}")
        return values

    def keys(self) -> List[str]:
        """The metric names, in the order the epochs first reported them."""
        return list(dict.fromkeys(k for row in self for k in row))

    def items(self) -> List[Tuple[str, List[Any]]]:
        """(metric, values per epoch) pairs, like Horovod's history dict."""
        return [(k, self[k]) for k in self.keys()]


class ToHistory(Converter):
    """A list of per-epoch dicts, held as a :class:`History`."""

    expected = "a list of per-epoch dicts"
    example = "[{'epoch': 1, 'loss': 0.5}]"

    def __call__(self, value: Any) -> History:
        if not isinstance(value, (list, tuple)) or not all(isinstance(row, dict) for row in value):
            raise self.fail(value)
        return History(value)


class ToList(Converter):
    """A list of arbitrary objects (callbacks, metrics); one object becomes a one-element list."""

    expected = "a list"
    example = "[]"

    def __call__(self, value: Any) -> List[Any]:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, (str, bytes, dict)):
            raise self.fail(value)
        return [value]


class ToChoice(Converter):
    """One of a fixed set of strings."""

    def __init__(self, choices: Sequence[str]) -> None:
        super().__init__()
        self.choices = tuple(choices)
        self.expected = "one of " + ", ".join(repr(c) for c in self.choices)
        self.example = repr(self.choices[0])

    def __call__(self, value: Any) -> str:
        if value not in self.choices:
            raise self.fail(value)
        return str(value)


class ToCallable(Converter):
    """A callable."""

    expected = "a callable (function or object with __call__)"

    def __call__(self, value: Any) -> Any:
        if not callable(value):
            raise self.fail(value)
        return value


class ToValidation(Converter):
    """A fraction in (0, 1) of rows held out, or the name of a 0/1 (or boolean) column."""

    expected = "a fraction strictly between 0 and 1, or the name of a 0/1 column"
    example = "0.2"

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise self.fail(value)
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) < 1.0:
            raise self.fail(value)
        return float(value)


class ToShapes(Converter):
    """One shape (list of positive ints, -1 allowed once) per feature (or label) column."""

    def __init__(self, what: str = "feature column", example: str = "[[1, 28, 28]]") -> None:
        super().__init__()
        self.expected = f"a list with one shape (a list of ints) per {what}"
        self.example = example

    def __call__(self, value: Any) -> List[List[int]]:
        if not isinstance(value, (list, tuple)) or not value:
            raise self.fail(value)
        shapes: List[List[int]] = []
        for shape in value:
            if not isinstance(shape, (list, tuple)) or any(
                    isinstance(d, bool) or not isinstance(d, numbers.Integral) or (d < 1 and d != -1)
                    for d in shape) or list(shape).count(-1) > 1:
                raise self.fail(value)
            shapes.append([int(d) for d in shape])
        return shapes


class ToStore(Converter):
    """A Store, or a path/URL turned into one with Store.create."""

    expected = "a spark_hvd.spark.Store or a path/URL"
    example = "Store.create('/tmp/spark-hvd')"

    def __call__(self, value: Any) -> Any:
        from spark_hvd.spark.data.store import Store

        if isinstance(value, Store):
            return value
        if isinstance(value, str) and value:
            return Store.create(value)
        raise self.fail(value)


# ---- declaration table -> mixin ---------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One Param: its name (also the constructor keyword), doc, default and converter."""

    name: str
    """Snake-case name; accessors are get/set plus the CamelCase name (batch_size -> getBatchSize)."""
    doc: str
    """One line shown by explainParams()."""
    default: Any
    """Default value; None means unset."""
    converter: Converter
    """Checks and normalizes values given to setters and constructors."""
    json: bool = True
    """Whether the value is plain JSON data; the rest (models, callables) must be pickled to persist."""
    unused: str = ""
    """For a Horovod Param that has no meaning here: why; setting it warns once with this reason."""

    @property
    def camel(self) -> str:
        """``batch_size`` -> ``BatchSize``."""
        return "".join(part[:1].upper() + part[1:] for part in self.name.split("_"))


def _getter(spec: ParamSpec) -> Callable[[Any], Any]:
    def get(self: Params) -> Any:
        return self.getOrDefault(getattr(self, spec.name))

    get.__name__ = get.__qualname__ = "get" + spec.camel
    get.__doc__ = f"Value of ``{spec.name}``: {spec.doc}"
    return get


def _setter(spec: ParamSpec) -> Callable[[Any, Any], Any]:
    def set_(self: Params, value: Any) -> Any:
        return self._set(**{spec.name: value})

    set_.__name__ = set_.__qualname__ = "set" + spec.camel
    set_.__doc__ = f"Set ``{spec.name}`` ({spec.doc}); returns self for chaining."
    return set_


class _DeclaredParams(Params):
    """Base of generated mixins: defaults from the table and keyword-only construction."""

    _param_specs: Tuple[ParamSpec, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        # None defaults are recorded too, so every getter answers (None) instead of raising KeyError.
        self._setDefault(**{s.name: s.default for s in self.param_specs()})
        self.setParams(**kwargs)

    @classmethod
    def param_specs(cls) -> Tuple[ParamSpec, ...]:
        """Every ParamSpec of this class, from all generated mixins it inherits."""
        seen: Dict[str, ParamSpec] = {}
        for klass in reversed(cls.__mro__):
            for spec in vars(klass).get("_param_specs", ()):
                seen[spec.name] = spec
        return tuple(seen.values())

    def setParams(self, **kwargs: Any) -> Any:
        """Set several Params by keyword; unknown names are refused with the valid ones listed."""
        known = {s.name for s in self.param_specs()}
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{type(self).__name__} got unknown parameter {key!r}{hint} "
                                 f"Known parameters: {', '.join(sorted(known))}")
        return self._set(**kwargs)

    def non_json_params(self) -> Dict[str, Any]:
        """Values of Params that are not plain JSON (models, optimizers, callables...), set or default."""
        return {s.name: self.getOrDefault(getattr(self, s.name)) for s in self.param_specs()
                if not s.json and self.isDefined(getattr(self, s.name))}


def params_mixin(name: str, specs: Iterable[ParamSpec], module: str = __name__,
                 bases: Tuple[Type[Params], ...] = (_DeclaredParams,)) -> Type[_DeclaredParams]:
    """A Params mixin class with one Param, getter and setter per spec.

    Assign the result to a module-level name equal to ``name`` in ``module``, so instances pickle.
    """
    specs = tuple(specs)
    namespace: Dict[str, Any] = {"_param_specs": specs, "__module__": module,
                                 "__doc__": f"Params of {name}: " + ", ".join(s.name for s in specs) + "."}
    for spec in specs:
        if not spec.name.isidentifier():
            raise ValueError(f"Param name {spec.name!r} is not an identifier")
        for attr in (spec.name, "get" + spec.camel, "set" + spec.camel):
            if attr in namespace:
                raise ValueError(f"Param {spec.name!r} is declared twice in {name}")
        spec.converter.bind(spec.name)
        namespace[spec.name] = Param(Params._dummy(), spec.name, spec.doc, typeConverter=spec.converter)
        namespace["get" + spec.camel] = _getter(spec)
        namespace["set" + spec.camel] = _setter(spec)
    cls = type(name, bases, namespace)
    cls.__qualname__ = name
    return cls


# ---- the tables -----------------------------------------------------------------------------

ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("num_proc", "Number of training processes, one Spark barrier task each.", None, ToInt(1)),
    ParamSpec("model", "The model to train (e.g. a torch.nn.Module).", None, AnyValue(), json=False),
    ParamSpec("optimizer", "Optimizer for the model's parameters.", None, AnyValue(), json=False),
    ParamSpec("loss", "Loss function, or a list with one per label column.", None, AnyValue(), json=False),
    ParamSpec("loss_weights", "Weight of each loss when there are several.", None, ToFloatList()),
    ParamSpec("metrics", "Metric functions evaluated every epoch.", None, ToList(), json=False),
    ParamSpec("feature_cols", "Input columns of the model.", None, ToStringList()),
    ParamSpec("label_cols", "Target columns of the model.", None, ToStringList()),
    ParamSpec("sample_weight_col", "Column of per-row loss weights.", None, ToString()),
    ParamSpec("validation", "Fraction in (0, 1) of rows held out for validation, or the name of a "
                            "0/1 column marking validation rows.", None, ToValidation()),
    ParamSpec("batch_size", "Rows per training step on each process.", 32, ToInt(1)),
    ParamSpec("val_batch_size", "Rows per validation step on each process (default: batch_size).",
              None, ToInt(1)),
    ParamSpec("epochs", "Passes over the training data.", 1, ToInt(1)),
    ParamSpec("train_steps_per_epoch", "Training steps per epoch (default: rows / (num_proc * "
                                       "batch_size), rounded up).", None, ToInt(1)),
    ParamSpec("validation_steps_per_epoch", "Validation steps per epoch (default: validation rows "
                                            "/ (num_proc * val_batch_size), rounded up).", None, ToInt(1)),
    ParamSpec("shuffle", "Shuffle row groups and rows every epoch.", True, ToBool()),
    ParamSpec("random_seed", "Seed for shuffling, the validation split and model initialization.",
              None, ToInt()),
    ParamSpec("store", "Where prepared data, checkpoints and logs are kept (a Store or path/URL).",
              None, ToStore(), json=False),
    ParamSpec("run_id", "Name of the run in the store; fitting again with the same id resumes it.",
              None, ToString()),
    ParamSpec("callbacks", "Callbacks called during training.", None, ToList(), json=False),
    ParamSpec("gradient_compression", "Compression of gradients for allreduce (e.g. "
                                      "spark_hvd.torch.Compression.fp16).", None, AnyValue(), json=False),
    ParamSpec("backward_passes_per_step", "Backward passes accumulated locally per allreduce.", 1, ToInt(1)),
    ParamSpec("input_shapes", "Shape of each feature column's per-row value (e.g. [[1, 28, 28]]).",
              None, ToShapes()),
    ParamSpec("transformation_fn", "Function applied to every batch (dict of arrays) before training.",
              None, ToCallable(), json=False),
    ParamSpec("train_minibatch_fn", "Replaces the training step: called with the model, optimizer, "
                                    "batch and loss function.", None, ToCallable(), json=False),
    ParamSpec("use_gpu", "Train on a GPU when one is available.", True, ToBool()),
    ParamSpec("verbose", "Progress reporting: 0 silent, 1 per epoch, 2 per step.", 1, ToInt(0)),
    ParamSpec("reader", "Parquet reader on the workers: 'builtin' or 'petastorm'.", "builtin",
              ToChoice(("builtin", "petastorm"))),
    ParamSpec("scale_lr", "Multiply the optimizer's learning rate by num_proc, as Horovod recommends.",
              True, ToBool()),
    ParamSpec("invalid_rows", "Rows with a null, NaN or infinite feature, label or weight: 'error' refuses "
                              "the DataFrame naming the columns and counts, 'skip' leaves those rows out.",
              "error", ToChoice(("error", "skip"))),
    ParamSpec("overwrite_run", "Start the run over when run_id holds a checkpoint of a different model, "
                               "optimizer, loss or data (otherwise fit refuses).", False, ToBool()),
    ParamSpec("task", "Prediction columns of the fitted model: 'auto' (from the loss), 'binary', "
                      "'binary_probability', 'multiclass', 'multiclass_log_probability', 'multiclass_probability', "
                      "'regression' or 'none' (raw outputs only).", "auto", ToChoice(TASKS)),
    ParamSpec("prediction_col", "Column of the predicted class index or value.", "prediction", ToString()),
    ParamSpec("probability_col", "Column of the Vector of class probabilities.", "probability", ToString()),
    ParamSpec("raw_prediction_col", "Column of the Vector of raw class scores.", "rawPrediction", ToString()),
    ParamSpec("log_to_mlflow", "Log Params, per-epoch metrics, timings and the model to MLflow: None when "
                               "a run is active, True always (starting a run), False never.", None, ToBool()),
    ParamSpec("max_retries", "Times fit() runs the training stage again, from the last checkpoint, after it "
                             "lost a task, a rank process or an executor (errors of the code are raised at once); "
                             "0 disables retries.", 3, ToInt(0)),
    ParamSpec("checkpoint_every_steps", "Also checkpoint every this many optimizer steps within an epoch, so "
                                        "a retry or resumed run continues mid-epoch (default: per epoch only).",
              None, ToInt(1)),
    ParamSpec("sharding", "How row groups reach the ranks when shuffle is on: 'reshuffle' deals them anew every "
                          "epoch (seeded, balanced by rows), so over the epochs every rank sees all of the data; "
                          "'fixed' keeps row group i on rank i % num_proc.", "reshuffle",
              ToChoice(("reshuffle", "fixed"))),
    ParamSpec("cleanup_intermediate", "Remove the fit's materialized data from the store after a successful "
                                      "fit (otherwise it is kept for the next fit of the same DataFrame).",
              False, ToBool()),
    ParamSpec("learning_rate", "Learning rate set on every parameter group of the optimizer before training (Keras: "
                               "the optimizer's learning_rate; Lightning: every optimizer configure_optimizers "
                               "returns, and its schedulers' base rates); unset: the optimizer's own. A plain number, "
                               "so ParamGridBuilder can tune it and tuning models save; with scale_lr (TorchEstimator, "
                               "KerasEstimator) the ranks multiply it by num_proc.", None, ToFloat(0.0, "1e-3")),
    ParamSpec("flush_denormal", "Flush subnormal floats to zero in the training processes' PyTorch CPU math, as "
                                "TensorFlow always does: a model whose weights or gradients drift into subnormal "
                                "values otherwise runs its matrix products several times slower on x86 CPUs. False "
                                "keeps IEEE subnormals, PyTorch's default (TensorFlow, under the Keras estimator, "
                                "flushes them either way).", True, ToBool()),
)
"""Params of the estimators: every one of TorchEstimator and KerasEstimator; LightningEstimator takes
those that mean the same for a LightningModule (see ``spark_hvd.spark.lightning.params``)."""

MODEL_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("model", "The trained model.", None, AnyValue(), json=False),
    ParamSpec("feature_cols", "Input columns of the model.", None, ToStringList()),
    ParamSpec("label_cols", "Target columns the model was trained on.", None, ToStringList()),
    ParamSpec("output_cols", "Raw output columns added by transform(), one per label column "
                             "(default: '<label>__output' when task is 'none').", None, ToStringList()),
    ParamSpec("input_shapes", "Shape of each feature column's per-row value.", None, ToShapes()),
    ParamSpec("inference_batch_size", "Rows per forward pass in transform().", 1024, ToInt(1)),
    ParamSpec("invalid_rows", "Rows whose features transform() cannot use (a null, NaN or infinite value, or an "
                              "array or Vector of another length than the model takes): 'error' fails naming the "
                              "column and the fix, 'skip' leaves them out, 'keep' keeps them with null prediction "
                              "columns.", "error", ToChoice(("error", "skip", "keep"))),
    ParamSpec("task", "Which prediction columns transform() adds (see the estimator's task).", "none",
              ToChoice(TASKS[1:])),
    ParamSpec("prediction_col", "Column of the predicted class index or value.", "prediction", ToString()),
    ParamSpec("probability_col", "Column of the Vector of class probabilities.", "probability", ToString()),
    ParamSpec("raw_prediction_col", "Column of the Vector of raw class scores.", "rawPrediction", ToString()),
    ParamSpec("run_id", "Name of the training run in the store.", None, ToString()),
    ParamSpec("history", "Per-epoch metrics of training: a list of dicts, also read as a dict of metric lists "
                         "(history['val_loss']).", None, ToHistory()),
)
"""Params of the fitted models (TorchModel, KerasModel)."""

class ToBackend(Converter):
    """A backend: a spark_hvd.spark.Backend (Horovod's SparkBackend), or any object with Horovod's
    Backend methods ``run(fn, args=(), env=None)`` and ``num_processes()``."""

    expected = ("a Backend such as spark_hvd.spark.common.backend.SparkBackend, or an object with Horovod's "
                "Backend methods run(fn, args=(), env=None) and num_processes()")
    example = "SparkBackend(num_proc=2)"

    def __call__(self, value: Any) -> Any:
        missing = [name for name in ("run", "num_processes") if not callable(getattr(value, name, None))]
        if missing:
            raise ValueError(f"backend={value!r} is not valid: it has no {' or '.join(m + '()' for m in missing)} "
                             f"method; expected {self.expected}, e.g. {self.example}")
        return value


_READER = "the reader reads Parquet row groups on one background thread per rank, with prefetch"

HOROVOD_ESTIMATOR_PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("backend", "How the ranks are run: a SparkBackend(num_proc=..., env=...), instead of num_proc.", None,
              ToBackend(), json=False),
    ParamSpec("shuffle_buffer_size", "Rows each process holds to shuffle within, filled from its row groups "
                                     "as they are read (default 10,000; 0 shuffles row groups only).", None, ToInt(0)),
    ParamSpec("partitions_per_process", "Parquet files written per process when the data is materialized "
                                        "(default: from the data's size).", None, ToInt(1)),
    ParamSpec("label_shapes", "Shape of each label column's per-row value as the loss receives it (e.g. [[1]]).",
              None, ToShapes("label column", "[[1]]")),
    ParamSpec("inmemory_cache_all", "Keep the rows a process reads in memory, decoded, after the first epoch, so "
                                    "later epochs read no files ('auto': when they fit a quarter of the memory "
                                    "available to the host's processes).", "auto", ToBoolOrAuto()),
    ParamSpec("transformation_removed_fields", "Columns removed from every batch after transformation_fn.",
              None, ToStringList()),
    ParamSpec("transformation_edit_fields", "Horovod's petastorm TransformSpec fields.", None, AnyValue(),
              json=False, unused="batches reach transformation_fn as dicts of numpy arrays, which it may change "
                                 "or extend without declaring the fields"),
    ParamSpec("train_reader_num_workers", "Horovod's petastorm reader workers for training data.", None, ToInt(1),
              unused=_READER),
    ParamSpec("val_reader_num_workers", "Horovod's petastorm reader workers for validation data.", None, ToInt(1),
              unused=_READER),
    ParamSpec("reader_pool_type", "Horovod's petastorm reader pool ('thread' or 'process').", None, ToString(),
              unused=_READER),
    ParamSpec("compress_sparse_cols", "Horovod's compression of SparseVector columns in the materialized data.",
              False, ToBool(), unused="Vector columns, sparse ones included, are stored as dense arrays"),
    ParamSpec("continuous_cols", "Horovod's continuous column names.", None, ToStringList(),
              unused="feature_cols names the model's inputs"),
    ParamSpec("categorical_cols", "Horovod's categorical column names.", None, ToStringList(),
              unused="feature_cols names the model's inputs; index categories first (StringIndexer)"),
    ParamSpec("mp_start_method", "Horovod's multiprocessing start method of the reader.", None, ToString(),
              unused="the reader starts no worker processes"),
    ParamSpec("tensorflow_dataset_prefetch_buffer_size", "Horovod's tf.data prefetch buffer.", None, ToInt(0),
              unused=_READER),
    ParamSpec("data_module", "Horovod's data module class.", None, AnyValue(), json=False,
              unused="every estimator reads the materialized Parquet with spark-hvd's reader (reader='builtin' or "
                     "'petastorm')"),
)
"""Horovod's EstimatorParams that spark-hvd's table does not have: each does what it did in Horovod,
or, where it has no meaning here (``unused``), is accepted with one warning saying why."""

EstimatorParams = params_mixin("EstimatorParams", ESTIMATOR_PARAMS + HOROVOD_ESTIMATOR_PARAMS)
ModelParams = params_mixin("ModelParams", MODEL_PARAMS)
