"""Training state of TensorFlow programs that can be committed, restored and synced across ranks.

Horovod's elastic state classes: ``TensorFlowState`` (variables) and ``TensorFlowKerasState``
(a Keras model and optimizer), each with plain attributes such as ``epoch`` and ``batch``, and
``run``, which calls the training function again in a new world after a lost peer or when the
elastic launcher has new workers (see spark_hvd.torch.elastic).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

import tensorflow as tf

from spark_hvd.runtime.elastic import ObjectState, State, VariableState, run_fn
from spark_hvd.runtime.errors import CollectiveError as HorovodInternalError
from spark_hvd.runtime.errors import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState", "run",
           "HorovodInternalError", "HostsUpdatedInterrupt"]


def _reset() -> None:
    from spark_hvd.tensorflow.basics import init, shutdown

    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)`` so that it resumes across changes of the world (every rank
    takes rank 0's state before each call; a lost peer restores the last commit first)."""
    return run_fn(func, _reset)


class TensorFlowState(VariableState):
    """``variables`` (tf.Variable objects) plus plain attributes given as keyword arguments.

    After ``sync()`` every rank holds rank 0's variable values and attributes, committed.
    """

    def __init__(self, variables: Optional[Iterable[tf.Variable]] = None, **kwargs: Any) -> None:
        self.variables = list(variables) if variables is not None else []
        super().__init__(**kwargs)

    def variables_to_keep(self) -> List[Any]:
        return self.variables


class TensorFlowKerasState(VariableState):
    """A Keras ``model`` and ``optimizer`` (default: the model's) plus plain attributes.

    After ``sync()`` every rank holds rank 0's weights, optimizer state and attributes, committed.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def variables_to_keep(self) -> List[Any]:
        optimizer_variables = list(getattr(self.optimizer, "variables", None) or [])
        return list(self.model.variables) + optimizer_variables


KerasState = TensorFlowKerasState
