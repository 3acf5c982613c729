"""Params declared from tables: generated accessors, defaults, conversion errors, copy, pickling."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
from pyspark.ml import Estimator, Model

from spark_hvd.spark.estimator.params import (ESTIMATOR_PARAMS, HOROVOD_ESTIMATOR_PARAMS, MODEL_PARAMS, EstimatorParams,
                                              ModelParams, ParamSpec, ToInt, params_mixin)
from spark_hvd.spark.data.store import LocalStore, Store


class ProbeEstimator(Estimator, EstimatorParams):
    """An Estimator built only from the generated mixin."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _fit(self, dataset):
        raise NotImplementedError


class ProbeModel(Model, ModelParams):
    """A Model built only from the generated mixin."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _transform(self, dataset):
        return dataset


ISSUE_PARAMS = [
    "num_proc", "model", "optimizer", "loss", "loss_weights", "metrics", "feature_cols", "label_cols",
    "sample_weight_col", "validation", "batch_size", "val_batch_size", "epochs", "train_steps_per_epoch",
    "validation_steps_per_epoch", "shuffle", "random_seed", "store", "run_id", "callbacks",
    "gradient_compression", "backward_passes_per_step", "input_shapes", "transformation_fn",
    "train_minibatch_fn", "use_gpu", "verbose", "reader", "scale_lr",
]
OUR_PARAMS = ["invalid_rows", "overwrite_run", "task", "prediction_col", "probability_col", "raw_prediction_col",
              "log_to_mlflow", "max_retries", "checkpoint_every_steps", "sharding", "cleanup_intermediate",
              "learning_rate", "flush_denormal"]
HOROVOD_ONLY = [s.name for s in HOROVOD_ESTIMATOR_PARAMS]


def test_estimator_table_declares_the_issue_params():
    """The estimator table has Horovod's Params, then ours, each with get/set methods."""
    assert [s.name for s in ESTIMATOR_PARAMS] == ISSUE_PARAMS + OUR_PARAMS
    est = ProbeEstimator()
    for spec in ESTIMATOR_PARAMS:
        assert callable(getattr(est, "get" + spec.camel)) and callable(getattr(est, "set" + spec.camel))
        assert est.hasParam(spec.name)
        assert spec.doc in est.explainParam(spec.name)
    assert {p.name for p in est.params} == set(ISSUE_PARAMS + OUR_PARAMS + HOROVOD_ONLY)
    assert "shuffle_buffer_size" in HOROVOD_ONLY and "backend" in HOROVOD_ONLY


def test_no_param_name_means_two_things():
    """A name the estimator and the model share has the same meaning (doc) and default in both."""
    model_specs = {s.name: s for s in MODEL_PARAMS}
    shared = [s for s in ESTIMATOR_PARAMS if s.name in model_specs]
    assert {s.name for s in shared} >= {"feature_cols", "label_cols", "prediction_col", "probability_col"}
    for spec in shared:
        other = model_specs[spec.name]
        # invalid_rows: the same choice for fit's rows and transform's, which can also keep them.
        assert spec.name in ("model", "run_id", "input_shapes", "task", "label_cols", "invalid_rows") or \
            spec.doc == other.doc, spec.name
        assert spec.name in ("task", "model") or spec.default == other.default, spec.name
    assert "batch_size" not in model_specs and model_specs["inference_batch_size"].default == 1024


@pytest.mark.parametrize("name, camel", [("batch_size", "BatchSize"), ("num_proc", "NumProc"),
                                         ("validation_steps_per_epoch", "ValidationStepsPerEpoch"),
                                         ("use_gpu", "UseGpu"), ("epochs", "Epochs")])
def test_accessor_names_are_camel_case(name, camel):
    """batch_size is read by getBatchSize and written by setBatchSize."""
    assert hasattr(EstimatorParams, "get" + camel) and hasattr(EstimatorParams, "set" + camel)
    assert next(s for s in ESTIMATOR_PARAMS if s.name == name).camel == camel


@pytest.mark.parametrize("getter, expected", [
    ("getBatchSize", 32), ("getEpochs", 1), ("getShuffle", True), ("getScaleLr", True),
    ("getReader", "builtin"), ("getUseGpu", True), ("getVerbose", 1), ("getBackwardPassesPerStep", 1),
    ("getModel", None), ("getNumProc", None), ("getValidation", None), ("getStore", None),
    ("getMaxRetries", 3), ("getCheckpointEverySteps", None), ("getCleanupIntermediate", False),
])
def test_defaults(getter, expected):
    """Unset Params answer their table default, None included."""
    assert getattr(ProbeEstimator(), getter)() == expected


def test_constructor_and_setters_convert_values():
    """Keyword construction and setters normalize values (floats to ints, one name to a list, paths to Stores)."""
    est = ProbeEstimator(batch_size=64.0, feature_cols="features", store="/tmp/spark-hvd-params")
    assert est.getBatchSize() == 64 and isinstance(est.getBatchSize(), int)
    assert est.getFeatureCols() == ["features"]
    assert est.getStore() == LocalStore("/tmp/spark-hvd-params")
    assert est.setEpochs(3) is est and est.getEpochs() == 3
    est.setValidation("is_val").setInputShapes([[1, 28, 28]])
    assert est.getValidation() == "is_val" and est.getInputShapes() == [[1, 28, 28]]
    est.setParams(epochs=5, verbose=0)
    assert (est.getEpochs(), est.getVerbose()) == (5, 0)


@pytest.mark.parametrize("name, value, fragment", [
    ("batch_size", 0, "batch_size=0 is not valid: expected an integer >= 1"),
    ("batch_size", "32", "expected an integer >= 1"),
    ("batch_size", True, "expected an integer"),
    ("epochs", 1.5, "epochs=1.5 is not valid"),
    ("shuffle", "yes", "shuffle='yes' is not valid: expected True or False"),
    ("validation", 1.0, "expected a fraction strictly between 0 and 1"),
    ("validation", 0, "expected a fraction strictly between 0 and 1"),
    ("feature_cols", [], "expected a list of column names"),
    ("feature_cols", ["a", 3], "expected a list of column names"),
    ("reader", "fast", "expected one of 'builtin', 'petastorm'"),
    ("transformation_fn", 3, "expected a callable"),
    ("input_shapes", [[0, 2]], "one shape"),
    ("loss_weights", ["a"], "expected a list of numbers"),
    ("store", 3, "expected a spark_hvd.spark.Store"),
    ("verbose", -1, "expected an integer >= 0"),
    ("learning_rate", -0.1, "learning_rate=-0.1 is not valid: expected a finite number >= 0; pass e.g. "
                            "learning_rate=1e-3"),
    ("learning_rate", float("nan"), "learning_rate=nan is not valid"),
    ("learning_rate", "0.1", "expected a finite number >= 0"),
])
def test_conversion_errors_name_the_param_and_the_fix(name, value, fragment):
    """Invalid values raise ValueError naming the Param, the value and what is expected."""
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(")):
        ProbeEstimator(**{name: value})
    setter = "set" + next(s for s in ESTIMATOR_PARAMS if s.name == name).camel
    with pytest.raises(ValueError, match=f"{name}="):
        getattr(ProbeEstimator(), setter)(value)


def test_unknown_keyword_is_refused_with_a_suggestion():
    """A misspelled keyword names itself, the closest Param and the valid ones."""
    with pytest.raises(ValueError, match="unknown parameter 'batchsize'; did you mean 'batch_size'"):
        ProbeEstimator(batchsize=3)


def test_constructor_is_keyword_only():
    """Positional constructor arguments are refused."""
    with pytest.raises(TypeError):
        ProbeEstimator(32)  # type: ignore[misc]


def _configured() -> ProbeEstimator:
    model = torch.nn.Linear(3, 1)
    return ProbeEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss=torch.nn.functional.mse_loss, store=Store.create("/tmp/spark-hvd-params"),
                          feature_cols=["x"], label_cols=["y"], batch_size=16)


def test_copy_keeps_non_json_values_and_applies_extra():
    """copy() (used by CrossValidator) keeps model, optimizer, loss and store; extra values override
    in the copy only."""
    est = _configured()
    twin = est.copy({est.batch_size: 8})
    assert twin.getModel() is est.getModel() and twin.getOptimizer() is est.getOptimizer()
    assert twin.getLoss() is est.getLoss() and twin.getStore() == est.getStore()
    assert (twin.getBatchSize(), est.getBatchSize()) == (8, 16)
    assert twin.uid == est.uid and twin.getEpochs() == 1


def test_params_pickle_with_models_and_stores():
    """Standard pickle round-trips an estimator holding a torch model, optimizer, loss and store."""
    est = _configured()
    back = pickle.loads(pickle.dumps(est))
    assert back.uid == est.uid
    assert torch.equal(back.getModel().weight, est.getModel().weight)
    assert back.getLoss() is torch.nn.functional.mse_loss
    assert back.getStore() == est.getStore()
    assert back.getBatchSize() == 16 and back.getFeatureCols() == ["x"]
    with pytest.raises(ValueError, match="batch_size=0"):
        back.setBatchSize(0)  # converters survive too


def test_cloudpickle_carries_lambdas():
    """Lambdas (transformation_fn) need cloudpickle, which round-trips them."""
    est = ProbeEstimator(transformation_fn=lambda batch: {k: v * 2 for k, v in batch.items()})
    back = cloudpickle.loads(cloudpickle.dumps(est))
    assert back.getTransformationFn()({"a": 2}) == {"a": 4}


def test_non_json_params_lists_values_that_need_pickling():
    """non_json_params() returns exactly the defined non-JSON Params."""
    est = _configured()
    assert set(est.non_json_params()) == {"model", "optimizer", "loss", "store", "metrics", "callbacks",
                                          "gradient_compression", "transformation_fn", "train_minibatch_fn",
                                          "backend", "transformation_edit_fields", "data_module"}
    assert est.non_json_params()["store"] == est.getStore()


def test_model_params():
    """The model mixin declares output_cols and the inference Params, with defaults."""
    model = ProbeModel(feature_cols=["x"], label_cols=["y"], output_cols=["y_hat"])
    assert [s.name for s in MODEL_PARAMS][:4] == ["model", "feature_cols", "label_cols", "output_cols"]
    assert model.getOutputCols() == ["y_hat"] and model.getInferenceBatchSize() == 1024
    assert (model.getTask(), model.getPredictionCol(), model.getProbabilityCol(), model.getRawPredictionCol()) == (
        "none", "prediction", "probability", "rawPrediction")
    assert model.copy().getOutputCols() == ["y_hat"]


def test_fitted_models_take_horovods_constructor_names():
    """TorchModel, KerasModel and LightningModel (Horovod's spark.lightning.TorchModel) take
    feature_columns= and label_columns= as Horovod's constructors do; both names of one Param at
    once are refused, naming them."""
    from spark_hvd.spark.keras import KerasModel
    from spark_hvd.spark.lightning import TorchModel as LightningTorchModel
    from spark_hvd.spark.torch import TorchModel

    for cls in (TorchModel, KerasModel, LightningTorchModel):
        model = cls(feature_columns=["a", "b"], label_columns=["y"], run_id="r1")
        assert (model.getFeatureCols(), model.getLabelCols(), model.getRunId()) == (["a", "b"], ["y"], "r1")
        assert (model.getFeatureColumns(), model.getLabelColumns()) == (["a", "b"], ["y"])
        assert model.setParams(label_columns=["z"]).getLabelCols() == ["z"]
        with pytest.raises(ValueError, match=r"both feature_columns= and feature_cols=.*same Param"):
            cls(feature_columns=["a"], feature_cols=["b"])


ExtendedParams = params_mixin("ExtendedParams", [ParamSpec("shuffle_buffer_rows", "Rows.", 100, ToInt(0))],
                              module=__name__, bases=(EstimatorParams,))


class ExtendedEstimator(Estimator, ExtendedParams):
    """An Estimator whose mixin extends the standard table."""

    def _fit(self, dataset):
        raise NotImplementedError


def test_mixins_extend_the_tables():
    """A mixin built on EstimatorParams has both tables' Params and pickles."""
    est = ExtendedEstimator(shuffle_buffer_rows=5, batch_size=4)
    assert (est.getShuffleBufferRows(), est.getBatchSize()) == (5, 4)
    assert pickle.loads(pickle.dumps(est)).getShuffleBufferRows() == 5
    with pytest.raises(ValueError, match="declared twice"):
        params_mixin("Twice", [ParamSpec("a", "A.", None, ToInt()), ParamSpec("a", "A.", None, ToInt())])


def test_inmemory_cache_all_is_auto_by_default_and_takes_a_bool():
    """Horovod's inmemory_cache_all defaults to 'auto' (cache what fits), takes True or False, and refuses
    anything else naming what it expects."""
    from spark_hvd.spark.torch import TorchEstimator

    assert TorchEstimator().getInmemoryCacheAll() == "auto"
    assert TorchEstimator(inmemory_cache_all=False).getInmemoryCacheAll() is False
    assert TorchEstimator().setInmemoryCacheAll(True).getInmemoryCacheAll() is True
    with pytest.raises(ValueError, match=r"inmemory_cache_all='always' is not valid: expected True, False or 'auto'"):
        TorchEstimator(inmemory_cache_all="always")


def test_a_fit_that_may_log_does_not_import_mlflow_to_learn_no_run_is_active(tmp_path):
    """log_to_mlflow unset: with MLflow installed but never imported no run can be active, so the
    fit does not pay MLflow's import; once it is imported without a run, still no logging."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from spark_hvd.spark.estimator.mlflow_log import start_logging\n"
        "assert start_logging(None) is None\n"
        "assert start_logging(False) is None\n"
        "assert 'mlflow' not in sys.modules, 'imported MLflow'\n"
        "import mlflow\n"
        "assert start_logging(None) is None\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
