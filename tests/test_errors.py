"""Every error spark-hvd raises survives pickle and copy with its message and its fields, so it can
cross a process, a multiprocessing queue or a Spark task boundary, and be copied by tools that do
(pytest, concurrent.futures, pyspark's tuning threads)."""

from __future__ import annotations

import copy
import pickle

import pytest

from spark_hvd.runner.errors import RankFailedError
from spark_hvd.runner.warm import WarmStartError
from spark_hvd.runtime import errors as rt_errors
from spark_hvd.runtime.elastic import WorldResizeRequested
from spark_hvd.runtime.nccl import NcclError, NcclUnavailable
from spark_hvd.spark.launch.barrier import SlotsUnavailableError, StageLostError


def _fields(error: BaseException):
    return {k: v for k, v in vars(error).items() if not k.startswith("_")}


def _same(got: BaseException, want: BaseException) -> None:
    assert type(got) is type(want)
    assert str(got) == str(want)
    assert got.args == want.args
    got_fields, want_fields = _fields(got), _fields(want)
    assert got_fields.keys() == want_fields.keys()
    for name, value in want_fields.items():
        if isinstance(value, BaseException):
            _same(got_fields[name], value)
        else:
            assert got_fields[name] == value, name


def _round_trips(error: BaseException) -> None:
    for how in (lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy):
        _same(how(error), error)


def _rank_failed() -> RankFailedError:
    reaction = RankFailedError(0, "rank 0 raised CollectiveError: lost rank 1",
                               exc_type="spark_hvd.runtime.errors.CollectiveError",
                               remote_traceback="Traceback (most recent call last):\n  ...\nCollectiveError: lost",
                               original=rt_errors.CollectiveError("lost", lost_rank=1))
    return RankFailedError(1, "rank 1 exited with code 0 before returning a result", output_tail=["[1]<stdout>:hi"],
                           reaction=reaction)


ERRORS = {
    "RankFailedError": lambda: RankFailedError(1, "x"),
    "RankFailedError with every field": _rank_failed,
    "SparkHvdError": lambda: rt_errors.SparkHvdError("base"),
    "CollectiveError": lambda: rt_errors.CollectiveError("peer lost", lost_rank=2),
    "RankMismatchError": lambda: rt_errors.RankMismatchError("shapes differ"),
    "RendezvousTimeout": lambda: rt_errors.RendezvousTimeout("only 1 of 2 ranks arrived"),
    "PeerUnreachableError": lambda: rt_errors.PeerUnreachableError("no route", host="10.0.0.2"),
    "AuthenticationError": lambda: rt_errors.AuthenticationError("bad proof"),
    "TamperedError": lambda: rt_errors.TamperedError("not sealed"),
    "NotInitializedError": lambda: rt_errors.NotInitializedError("allreduce()"),
    "HostsUpdatedInterrupt": lambda: rt_errors.HostsUpdatedInterrupt(skip_sync=True),
    "WorldResizeRequested": lambda: WorldResizeRequested("grow to 3"),
    "NcclError": lambda: NcclError("unhandled system error"),
    "NcclUnavailable": lambda: NcclUnavailable("no GPU"),
    "WarmStartError": lambda: WarmStartError("could not import torch"),
    "SlotsUnavailableError": lambda: SlotsUnavailableError("2 slots for 3 tasks"),
    "StageLostError": lambda: StageLostError("executor lost"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_survives_pickle_and_copy_with_its_fields(name):
    _round_trips(ERRORS[name]())


def test_a_rank_failed_error_keeps_its_rank_summary_and_reaction_after_pickle():
    error = pickle.loads(pickle.dumps(_rank_failed()))
    assert (error.rank, error.summary, error.output_tail) == \
        (1, "rank 1 exited with code 0 before returning a result", ("[1]<stdout>:hi",))
    assert error.reaction.rank == 0 and error.reaction.original.lost_rank == 1
    assert not error.lost_a_peer() and error.reaction.lost_a_peer()
    assert "Traceback from rank 0" in str(error)


def test_not_initialized_error_keeps_its_message_after_pickle():
    error = pickle.loads(pickle.dumps(rt_errors.NotInitializedError("allreduce()")))
    assert str(error).count("call init() before allreduce()") == 1


def test_hosts_updated_interrupt_keeps_skip_sync_after_pickle():
    for skip in (False, True):
        assert pickle.loads(pickle.dumps(rt_errors.HostsUpdatedInterrupt(skip_sync=skip))).skip_sync is skip


def test_tensorflow_errors_survive_pickle_and_copy():
    """The TensorFlow binding's errors (also tf.errors types, as Horovod's are) round-trip too."""
    from spark_hvd.tensorflow.bridge import InvalidArgument, MismatchError

    for error in (MismatchError("ranks disagree on the shape"), InvalidArgument("op=Adasum is not supported")):
        for how in (lambda e: pickle.loads(pickle.dumps(e)), copy.copy):
            got = how(error)
            assert type(got) is type(error) and str(got) == str(error) and got.message == error.message
