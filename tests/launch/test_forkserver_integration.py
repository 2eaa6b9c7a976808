"""Ranks forked from a fork server (launch/forkserver.py): replays on them are bit for bit the record, each job
in new ranks of the same server; a rank's own error reaches this process's stderr and its exit code or signal
the failure, as a fresh rank's do. A script fork server's ranks run a user's script as fresh processes of it
would. (That they die with the command: test_lifeline_integration.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replay.errors import ReplayError
from replay.launch.forkserver import ForkServer
from replay.launch.job import RankJob
from replay.processes import alive, descendants
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.location import Location
from replay.store.overrides import Overrides
from replay.store.verification import STATE


def test_replays_forked_from_one_server_are_bit_for_bit_each_in_new_ranks(store_copy):
    with ForkServer() as server:
        assert server.wait_ready(), server.refused   # it imported, and is one thread: it forks
        plain = run(store_copy, ReplayRequest(12, 14), ranks=server)
        assert plain.created and plain.verification.bitwise, plain.verification
        first_ranks = server.forked
        # a counterfactual in between (another attention function registered with transformers): nothing of it
        # may reach the ranks forked after it
        changed = run(store_copy, ReplayRequest(12, 14, overrides=Overrides(attention="fa2-emu:br=16,bc=16",
                                                                            layers=[1])), ranks=server)
        v = changed.verification
        assert not v.bitwise and v.level == STATE and v.divergence.step == 12, v
        again = run(store_copy, ReplayRequest(13, 19), ranks=server)
        assert again.created and again.verification.bitwise, again.verification
        assert len(server.forked) == 2 and not set(server.forked) & set(first_ranks)   # new ranks for every job
        assert server.alive and not descendants(server.pid)   # the server outlives its jobs; no rank does


def test_a_forked_ranks_own_error_and_exit_code_reach_this_process(store_copy, capfd):
    lease = json.dumps({"file": str(store_copy / "no-such-lease"), "token": "t"})
    with ForkServer() as server:
        with pytest.raises(ReplayError, match=r"^rank \d exited with code 2, then rank \d exited with code 2; their "
                                              "own messages are above"):
            server.run(RankJob(Location.parse(store_copy), lease, False, 2))
        err = capfd.readouterr().err
        for rank in (0, 1):   # each printed its own line, as a fresh rank does, to this process's stderr
            assert f"rank {rank}: the lease this process writes under ({store_copy / 'no-such-lease'}) is no " \
                   "longer held" in err, err


def test_a_forked_rank_killed_fails_the_replay_and_the_next_resumes_on_the_same_server(store_copy, monkeypatch):
    monkeypatch.setenv("REPLAY_FAULT", "shard-half:15:1")   # rank 1 SIGKILLed writing the final checkpoint
    with ForkServer() as server:
        with pytest.raises(ReplayError, match=r"^rank 1 was killed by signal 9 \(SIGKILL\)"):
            run(store_copy, ReplayRequest(12, 14), ranks=server)
        monkeypatch.delenv("REPLAY_FAULT")
        pid = server.pid
        again = run(store_copy, ReplayRequest(12, 14, resume=True), ranks=server)
        assert again.created and again.verification.bitwise, again.verification
        assert RunStore.open(again.location).manifest.status == "complete" and server.pid == pid


PROBE = """
import ctypes, json, os, sys
import numpy as np
library = next(line.split()[-1] for line in open("/proc/self/maps")
               if "openblas" in line.rpartition("/")[2] and ".so" in line)
blas = ctypes.CDLL(library).scipy_openblas_get_num_threads64_
fds = [int(fd) for fd in os.environ.get("PROBE_FDS", "").split(",") if fd]
with open(sys.argv[1], "w") as f:
    json.dump({"blas_threads": blas(), "draw": int(np.random.randint(1 << 30)), "argv": sys.argv[1:],
               "main": __name__, "path0": sys.path[0], "cwd": os.getcwd(), "orig_argv": sys.orig_argv[1:],
               "fds": [os.fstat(fd).st_size >= 0 for fd in fds], "rank": os.environ.get("RANK")}, f)
import atexit, pickle, threading, time
class Thing: pass
def late():   # a non-daemon thread the interpreter's exit waits for, as threading's exit hooks run
    time.sleep(0.2)
    with open(sys.argv[1] + ".late", "w") as f:
        f.write(str(len(pickle.dumps(Thing()))))   # by reference to __main__, still the script's
@atexit.register
def at_exit():
    import __main__
    open(sys.argv[1] + ".exit", "w").write(__main__.Thing.__name__)
open(sys.argv[1] + ".unclosed", "w").write("kept")   # flushed as the script's __main__ is torn down
threading.Thread(target=late).start()
if os.environ.get("PROBE_INTERRUPT"):
    raise KeyboardInterrupt
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def _script_image(tmp_path, imports=("numpy", "torch")):
    from replay.launch.forkserver import ScriptImage

    (tmp_path / "probe.py").write_text(PROBE)
    return ScriptImage(tuple(imports), {**os.environ, "OMP_NUM_THREADS": "1"}, str(tmp_path))


def test_a_scripts_forked_ranks_run_it_as_fresh_processes_would(tmp_path):
    """A script fork server (started in the script's directory, numpy and torch imported, OpenBLAS held to one
    thread so that it may fork) forks two ranks of `python -u probe.py OUT`: each runs the script as __main__ with
    its argv, sys.path[0] and working directory, gets its own descriptors named in the variable asked for, draws
    its own numpy numbers and has OpenBLAS's threads as a fresh process of the script has them; its exit waits for
    the script's threads, runs its exit hooks with its __main__ in place, flushes its unclosed files, and ends
    with the script's exit code, or by SIGINT after an uncaught Ctrl-C."""
    image = _script_image(tmp_path)
    fresh = subprocess.run([sys.executable, "-u", "probe.py", str(tmp_path / "fresh.json")], cwd=tmp_path,
                           env=dict(image.env), capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    expected = json.loads((tmp_path / "fresh.json").read_text())
    pipes = [os.pipe() for _ in range(2)]
    with ForkServer(image) as server:
        outs = [tmp_path / f"rank{r}.json" for r in range(2)]
        ranks = [server.fork_script(["-u", "probe.py", str(out)], [{**image.env, "RANK": str(r), "PROBE_EXIT": str(r)}],
                                    "PROBE_FDS", [pipes[r]]) for r, out in enumerate(outs)]
        assert all(r is not None for r in ranks), server.refused
        interrupted = server.fork_script(["probe.py", str(tmp_path / "interrupted")],
                                         [{**image.env, "PROBE_INTERRUPT": "1"}], "PROBE_FDS", [()])
        codes = [rank[0].wait(timeout=120) for rank in [*ranks, interrupted]]
        server_pid = server.pid
    assert codes == [0, 1, -signal.SIGINT]   # the script's own sys.exit; an uncaught Ctrl-C ends it by SIGINT
    seen = [json.loads(out.read_text()) for out in outs]
    for r, got in enumerate(seen):
        assert got["rank"] == str(r) and got["fds"] == [True, True]
        assert got["main"] == "__main__" and got["argv"] == [str(outs[r])]
        assert (got["path0"], got["cwd"]) == (expected["path0"], expected["cwd"]) == (str(tmp_path), str(tmp_path))
        assert got["orig_argv"] == ["-u", "probe.py", str(outs[r])]
        assert got["blas_threads"] == expected["blas_threads"], (got, expected)
        assert int(Path(f"{outs[r]}.late").read_text()) > 0   # the exit waited for the script's thread
        assert Path(f"{outs[r]}.exit").read_text() == "Thing" and Path(f"{outs[r]}.unclosed").read_text() == "kept"
    assert seen[0]["draw"] != seen[1]["draw"]   # numpy's global generator seeded anew in each, as in fresh ones
    assert not alive(server_pid)


def test_a_script_fork_server_that_cannot_import_a_package_refuses_in_words(tmp_path):
    with ForkServer(_script_image(tmp_path, imports=("numpy", "no_such_package_here"))) as server:
        assert server.fork_script(["probe.py", str(tmp_path / "out.json")], [dict(os.environ)], "PROBE_FDS",
                                  [()]) is None
        assert "importing no_such_package_here failed (ModuleNotFoundError" in server.refused
