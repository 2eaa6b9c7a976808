"""Which launcher started `replay record` as one of its ranks (launch/ranks.py `outer_launcher`): the variables
torchrun and DeepSpeed's launcher set are taken for theirs, and a rank's variables left over without a launcher
are refused in one line (they made the command wait for ranks that never came)."""

from __future__ import annotations

import socket

import pytest

from replay.config import Launcher
from replay.errors import UsageError
from replay.launch.forkserver import ForkServer
from replay.launch.fresh import FreshRanks
from replay.launch.job import RANKS_ENV
from replay.launch.pool import RankPool
from replay.launch.ranks import (
    RANK_VARIABLES,
    InProcess,
    choose_launcher,
    outer_launcher,
    refuse_rank_variables,
)
from replay.launch.script import ScriptRanks
from replay.store.manifest import CommandInfo


@pytest.fixture
def environment(monkeypatch):
    for name in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE", "CROSS_RANK", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def set_(**variables: object) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, str(value))
    return set_


@pytest.fixture
def agent():
    """A port that answers, as a torchrun agent's store does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def _torchrun(port: int, **more: object) -> dict[str, object]:
    return {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 0,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "True", **more}


def test_without_a_ranks_variables_this_process_starts_the_ranks(environment):
    assert outer_launcher() is None and outer_launcher(nproc=2) is None
    refuse_rank_variables()


def test_the_variables_torchrun_and_deepspeed_set_are_taken_for_their_ranks(environment, agent):
    environment(**_torchrun(agent))
    assert outer_launcher() == "torchrun"
    environment(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=1)   # rank 0 hosts the store: nothing to ask yet
    assert outer_launcher() == "torchrun"


def test_deepspeeds_launcher_is_taken_for_its_ranks(environment):
    environment(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_SIZE=2, CROSS_RANK=0, MASTER_ADDR="127.0.0.1",
                MASTER_PORT=29500)
    assert outer_launcher() == "deepspeed"


@pytest.mark.parametrize("variables, says", [
    ({"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500},
     "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 are set in the environment, but no launcher "
     "started this process as one of its ranks"),
    ({"WORLD_SIZE": 4}, "WORLD_SIZE=4 is set in the environment, but no launcher"),
    ({"RANK": 2, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 1, "MASTER_ADDR": "h",
      "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "x"}, "no launcher started this process"),   # rank 2 of 2
])
def test_a_ranks_variables_without_their_launcher_are_refused_saying_how_to_unset_them(environment, variables, says):
    environment(**variables)
    with pytest.raises(UsageError, match=says) as e:
        outer_launcher()
    assert f"(`unset {' '.join(variables)}`)" in str(e.value)
    assert str(e.value).endswith("to record on this machine's ranks, or start the command under torchrun")


def test_an_agent_that_has_gone_is_named(environment):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    environment(**_torchrun(port))
    with pytest.raises(UsageError, match=f"no torchrun agent answers at 127.0.0.1:{port}"):
        outer_launcher()


def test_nproc_under_a_launcher_and_a_ranks_variables_in_one_that_starts_its_own_are_refused(environment, agent):
    environment(**_torchrun(agent))
    with pytest.raises(UsageError, match="but --nproc 2 starts this machine's ranks: leave out --nproc"):
        outer_launcher(nproc=2)
    with pytest.raises(UsageError, match="but this command starts its ranks itself: unset them"):
        refuse_rank_variables()


# How a run's ranks start (launch/ranks.py `choose_launcher`), without starting any: the one place it is decided.

def test_local_ranks_are_forked_one_runs_here_and_deepspeeds_start_fresh(monkeypatch):
    monkeypatch.delenv(RANKS_ENV, raising=False)
    assert isinstance(choose_launcher(Launcher.LOCAL, 2), ForkServer)
    assert isinstance(choose_launcher(Launcher.LOCAL, 1), InProcess)
    assert isinstance(choose_launcher(Launcher.DEEPSPEED, 2), FreshRanks)
    monkeypatch.setenv(RANKS_ENV, "fresh")
    assert isinstance(choose_launcher(Launcher.LOCAL, 2), FreshRanks)
    monkeypatch.setenv(RANKS_ENV, "warm")
    with pytest.raises(UsageError, match="REPLAY_RANKS=warm: set it to `fresh`"):
        choose_launcher(Launcher.LOCAL, 2)


def test_the_callers_ranks_are_taken_where_they_fit_and_a_script_runs_as_recorded():
    pool = RankPool(2)
    assert choose_launcher(Launcher.LOCAL, 2, given=pool) is pool
    assert isinstance(choose_launcher(Launcher.LOCAL, 4, given=pool), ForkServer)   # another world size
    assert isinstance(choose_launcher(Launcher.DEEPSPEED, 2, given=pool), FreshRanks)
    command = CommandInfo(argv=["train.py"], cwd="/", launcher="python", world_size=1, files={})
    assert isinstance(choose_launcher(Launcher.CUSTOM, 1, command, given=pool), ScriptRanks)
    server = ForkServer()
    assert choose_launcher(Launcher.LOCAL, 3, given=server) is server
    assert not pool.alive and not server.alive   # nothing was started
