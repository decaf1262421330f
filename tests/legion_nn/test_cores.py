import os
import threading

from legion_nn import cores


def test_the_cores_are_those_this_process_may_run_on():
    assert cores.host_cores() == len(os.sched_getaffinity(0))
    assert cores.spare_cores() == cores.host_cores() - 1


def test_a_process_running_another_thread_is_not_forked():
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not cores.can_fork()
    finally:
        release.set()
        other.join()
