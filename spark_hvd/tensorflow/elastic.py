"""Training state of TensorFlow programs that can be committed, restored and synced across ranks.

Horovod's elastic state classes: ``TensorFlowState`` (variables) and ``TensorFlowKerasState``
(a Keras model and optimizer), each with plain attributes such as ``epoch`` and ``batch``.
Re-forming a world after a failure belongs to the elastic driver.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import tensorflow as tf

from spark_hvd.runtime.elastic import ObjectState, State, VariableState

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState"]


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
