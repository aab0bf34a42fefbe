"""ringmpi.collective across ranks: one error everywhere, root-only work, and agreements that
notice Ctrl-C while a rank waits for the others (a CI run once caught an early rank sitting
in a blocking allgather while the interrupted one aborted the job)."""

import os
import signal

import pytest
from mpi4py import MPI

from ringmpi import collective
from ringmpi.collective import CollectiveError, any_rank, run_everywhere, run_on_root
from ringmpi.runtime import interrupt
from ringmpi.testing import assert_all

pytestmark = pytest.mark.mpi


class Named(CollectiveError):
    """A CollectiveError subclass: it keeps its type on every rank (pickled by name)."""


def test_any_rank_is_true_everywhere_when_one_rank_says_so(comm):
    last = comm.size - 1
    assert_all(comm, any_rank(comm, comm.rank == last) is True, "the last rank's flag was lost")
    assert_all(comm, any_rank(comm, False) is False, "no rank raised a flag")
    assert any_rank(None, True) is True and any_rank(MPI.COMM_SELF, False) is False


def test_a_failure_on_one_rank_is_the_same_error_everywhere(comm):
    last = comm.size - 1

    def step(x):
        if comm.rank == last:
            raise ValueError(f"bad value {x}")
        return x + 1

    with pytest.raises(CollectiveError) as e:
        run_everywhere(comm, step, 41)
    want = f"rank {last}: ValueError: bad value 41" if comm.size > 1 else "ValueError: bad value 41"
    assert_all(comm, str(e.value) == want, str(e.value))

    def named():
        if comm.rank == 0:
            raise Named("the file says no")

    with pytest.raises(Named, match="^the file says no$"):
        run_everywhere(comm, named)
    got = run_everywhere(comm, lambda x: x * comm.rank, 3)
    assert_all(comm, got == 3 * comm.rank, f"rank {comm.rank}: {got}")


def test_run_on_root_hands_rank_0s_result_to_every_rank(comm):
    got = run_on_root(comm, lambda: ("rank", comm.rank))
    assert_all(comm, got == ("rank", 0), str(got))


def test_the_agreement_communicator_is_made_once_and_freed_with_its_own(comm):
    mine = comm.Dup()
    any_rank(mine, False)
    dup = collective._meeting_comm(mine)
    assert_all(comm, collective._meeting_comm(mine) is dup, "a second duplicate was made")
    assert_all(comm, dup != mine and dup.Get_size() == comm.size, "not a duplicate of it")
    if comm.size > 1:
        mine.Free()  # the attribute's delete callback frees the duplicate
        assert_all(comm, dup == MPI.COMM_NULL, "the duplicate outlived its communicator")


def test_a_rank_interrupted_while_waiting_leaves_and_the_others_go_on(comm):
    """Rank 0 gets SIGINT before the others have even started the agreement: it raises
    Interrupted at once instead of waiting in MPI for them (the others start only after
    its message that it left, so a rank 0 that waited would hang the test into its
    timeout), and its posted contribution still lets the others complete."""
    if comm.size < 2:
        pytest.skip("needs a late rank")
    if comm.rank == 0:
        with interrupt.catching():
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(interrupt.Interrupted):
                any_rank(comm, True)
        for r in range(1, comm.size):
            comm.send("left", dest=r, tag=77)
        ok = len(collective._LEFT) >= 1  # the pending request stays referenced
    else:
        assert comm.recv(source=0, tag=77) == "left"
        ok = any_rank(comm, False) is True  # rank 0's flag arrived
    assert_all(comm, ok, f"rank {comm.rank}")
