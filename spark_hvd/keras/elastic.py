"""Training state of Keras programs (model, optimizer, plain attributes) that can be committed, restored and synced."""

from __future__ import annotations

from typing import Any, Callable, List

from spark_hvd.runtime.elastic import ObjectState, State, VariableState, run_fn

__all__ = ["State", "ObjectState", "KerasState", "run"]


def _reset() -> None:
    from spark_hvd.keras.basics import init, shutdown

    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)`` so that it resumes across changes of the world (see
    spark_hvd.torch.elastic.run)."""
    return run_fn(func, _reset)


class KerasState(VariableState):
    """A Keras ``model`` and ``optimizer`` (default: the model's) plus plain attributes (``epoch=0``).

    After ``sync()`` every rank holds rank 0's weights, optimizer state and attributes,
    committed; ``restore()`` returns to the last commit. Works on every Keras backend.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def variables_to_keep(self) -> List[Any]:
        from spark_hvd.keras.callbacks import optimizer_variables

        return list(self.model.variables) + (optimizer_variables(self.optimizer) if self.optimizer is not None else [])
