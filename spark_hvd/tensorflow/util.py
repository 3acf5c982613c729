"""``hvd.util``: the helpers Horovod's TensorFlow users reach through ``horovod.tensorflow.util``.

``vars_to_refs`` / ``refs_to_vars`` turn (nested lists of) variables into hashable references and
back, for sets and dict keys of variables; ``_executing_eagerly`` is what Horovod's own tests ask
to choose between eager and graph checks.
"""

from __future__ import annotations

from typing import Any

from spark_hvd.tensorflow.bridge import executing_eagerly as _executing_eagerly

__all__ = ["vars_to_refs", "refs_to_vars", "_executing_eagerly"]


def vars_to_refs(variables: Any) -> Any:
    """``variables`` (a variable or a nested list of them) as hashable references (``v.ref()``)."""
    if isinstance(variables, list):
        return [vars_to_refs(v) for v in variables]
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The variables behind ``refs`` (a reference or a nested list of them): inverse of :func:`vars_to_refs`."""
    if isinstance(refs, list):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
