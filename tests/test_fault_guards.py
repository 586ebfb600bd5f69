"""The pieces behind the job's production-fault handling, each on its own (the job-level cases are
in tests/test_production_faults.py): the one-line errors, the feature-id check, the run-dir lock,
the peer watchdog's verdicts, SIGTERM's flag, and the checkpoint's configuration and state checks."""

import doctest
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_job.training import errors, feature_ids, preemption, run_dir_lock
from loka_job.training.checkpoint import config_mismatch, state_mismatch
from loka_job.training.errors import ConfigError, JobError, error_line
from loka_job.training.feature_ids import FeatureIdCheck, FeatureIdError
from loka_job.training.peer_watchdog import END_OF_RUN, PeerWatchdog
from loka_job.training.preemption import StopSignal
from loka_job.training.run_dir_lock import LOCK_FILE, RunDirLocked, lock_run_dir


@pytest.mark.parametrize("module", [errors, feature_ids, preemption, run_dir_lock])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "exc, line",
    [
        (ValueError("train.steps: expected an int, got 'abc'"), "error: expected an int, got 'abc' (train.steps)"),
        (ValueError("model.hidden must be an int >= 1, got 0"), "error: model.hidden must be an int >= 1, got 0 (model.hidden)"),
        (ConfigError("train.resume: '/x' does not exist\nmore"), "error: '/x' does not exist (train.resume)"),
        (JobError("train: the loss was not finite", field="train.max_nonfinite_steps"),
         "error: train: the loss was not finite (train.max_nonfinite_steps)"),
        (ValueError("no field named here"), "error: no field named here"),
    ],
)  # fmt: skip
def test_an_error_is_one_line_naming_its_field(exc, line):
    assert error_line(exc) == line


def _ids(**features):
    keys = list(features)
    values = torch.tensor([v for ids in features.values() for v in ids])
    lengths = torch.tensor([1] * len(values))  # one id per sample, batch size len(ids) per key
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def test_ids_outside_their_table_are_named_with_the_feature_the_table_and_the_value():
    check = FeatureIdCheck({"small": ("t_small", 10), "large": ("t_large", 1000)})
    check.check(_ids(small=[0, 9], large=[999, 500]), where="batch 0")  # every id fits its own table
    with pytest.raises(FeatureIdError) as err:
        check.check(_ids(small=[3, 4], large=[7, 1000]), where="train batch 5 of rank 1")
    assert str(err.value) == "id 1000 of feature large is past the end of table t_large (1000 rows: ids 0 to 999), in train batch 5 of rank 1"
    assert error_line(err.value).endswith("(feature large)") and not err.value.every_rank
    with pytest.raises(FeatureIdError, match=r"^id -1 of feature small is negative: table t_small has 10 rows \(ids 0 to 9\), in batch 2$"):
        check.check(_ids(small=[-1, 4], large=[7, 8]), where="batch 2")
    with pytest.raises(FeatureIdError, match="id 10 of feature small"):  # within the large table, past the small one
        check.check(_ids(small=[10, 4], large=[7, 8]), where="batch 3")
    check.check(_ids(other=[-5, 10**6]), where="batch 4")  # a feature no table reads is not checked


def test_the_model_tables_are_found_and_checked_batch_by_batch():
    from torchrec.datasets.utils import Batch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0", "f1"])],
        device=torch.device("meta"),
    )
    check = FeatureIdCheck.of_model(torch.nn.Sequential(ebc))
    assert check.tables == {"f0": ("t0", 50), "f1": ("t0", 50)}
    batches = [Batch(torch.zeros(2, 1), _ids(f0=[1, 2], f1=[3, 50 + i]), torch.zeros(2)) for i in (-10, 0)]
    checked = check.checked(batches, split="eval", first_batch=7, rank=0)
    next(checked)
    with pytest.raises(FeatureIdError, match=r"id 50 of feature f1 .*, in eval batch 8 of rank 0$"):
        next(checked)


def test_a_run_dir_lock_refuses_a_second_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    lock = lock_run_dir(str(tmp_path))
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and lock.took_over is None
    with pytest.raises(RunDirLocked) as err:  # another open file description: flock conflicts even in one process
        lock_run_dir(str(tmp_path))
    assert str(err.value).startswith(f"run dir {tmp_path} is in use by another job (pid {os.getpid()} on {holder['host']}, running")
    assert err.value.field == "hydra.run.dir" and "\n" not in str(err.value)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    # a holder that died without releasing: its pid stays in the file, its flock went with it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout), "host": holder["host"], "started": "then"}))
    lock = lock_run_dir(str(tmp_path))
    assert lock.took_over == (
        f"run dir {tmp_path}: took over the lock of a job that ended without releasing it "
        f"(pid {int(dead.stdout)} on {holder['host']}, not running, started then)"
    )
    lock.release()


def test_sigterm_sets_the_flag_instead_of_ending_the_process():
    stop = StopSignal()
    stop.install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.received == "SIGTERM"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _store():
    from loka_job.training.distributed import _free_port

    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return server, port


def _watchdogs(port, world_size, timeout_s, prefix):
    verdicts = {}
    done = threading.Event()

    def on_timeout(rank):
        def report(message, missing):
            verdicts[rank] = (message, missing)
            done.set()

        return report

    dogs = [
        PeerWatchdog(r, world_size, timeout_s=timeout_s, on_timeout=on_timeout(r), host="127.0.0.1", port=port, prefix=prefix)
        for r in range(world_size)
    ]
    return dogs, verdicts, done


def _wait(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_the_watchdog_names_a_peer_that_stopped_and_waits_for_peers_that_are_alive():
    server, port = _store()
    dogs, verdicts, done = _watchdogs(port, 3, timeout_s=1.0, prefix="t1")
    for dog in dogs:
        dog.start()
    for dog in dogs:
        dog.reached(3)
    assert _wait(lambda: all(server.add(f"t1/{r}/step", 0) == 3 for r in range(3)))
    dogs[2].stop()  # rank 2 "stopped": no heartbeat from here on, still at step 3
    # ranks 0 and 1 wait in step 4; rank 1 is alive and as far, rank 2 is not running
    assert done.wait(30), "no verdict"
    assert _wait(lambda: len(verdicts) == 2)
    for rank in (0, 1):
        message, missing = verdicts[rank]
        assert missing == [2], message
        assert message.startswith("rank(s) 2 did not arrive within train.peer_timeout_s=1 (rank 2: no sign of life, last seen after step 3)")
        assert f"this rank ({rank}) waited" in message and message.endswith("in step 4")
    for dog in dogs:
        dog.stop()


def test_the_watchdog_waits_for_peers_that_are_as_far_and_alive_however_long():
    server, port = _store()
    dogs, verdicts, done = _watchdogs(port, 2, timeout_s=0.5, prefix="t2")
    for dog in dogs:
        dog.start()
        dog.reached(END_OF_RUN)  # both at the end, both alive: a long final evaluation
    assert not done.wait(3) and verdicts == {}
    for dog in dogs:
        dog.stop()


def _as_dict(**shapes):
    return {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}


def test_a_saved_state_that_does_not_fit_the_model_is_named_by_its_first_key():
    model = _as_dict(a=((4, 2), torch.float32), b=((3,), torch.float32))
    assert state_mismatch(_as_dict(a=((4, 2), torch.float32), b=((3,), torch.float32)), model) is None
    assert state_mismatch(_as_dict(a=((4, 2), torch.float32), b=((5,), torch.float32)), model) == "b is (5,) float32 there, (3,) float32 here"
    assert state_mismatch(_as_dict(a=((4, 2), torch.bfloat16), b=((3,), torch.float32)), model) == "a is (4, 2) bfloat16 there, (4, 2) float32 here"
    assert state_mismatch(_as_dict(a=((4, 2), torch.float32)), model) == "b is not in the checkpoint (1 key(s) missing)"
    assert state_mismatch({**model, "c": torch.zeros(1)}, model) == "c is in the checkpoint but not in this model (1 key(s) more)"


def test_the_recorded_configuration_is_compared_field_by_field():
    recorded = {"model": {"name": "dlrm", "sizes": [64, 32]}, "tables": {"t0": {"rows": 1000}}}
    assert config_mismatch(recorded, {"model": {"name": "dlrm", "sizes": (64, 32)}, "tables": {"t0": {"rows": 1000}}}) is None
    assert config_mismatch(recorded, {"model": {"name": "dlrm", "sizes": [64, 32]}, "tables": {"t0": {"rows": 2000}}}) == ("tables.t0.rows", 1000, 2000)
    assert config_mismatch(recorded, {"model": {"name": "dcn", "sizes": [64, 32]}, "tables": {"t0": {"rows": 1000}}}) == ("model.name", "dlrm", "dcn")
    assert config_mismatch(recorded, {"model": {"name": "dlrm", "sizes": [64, 32], "extra": 1}, "tables": {"t0": {"rows": 1000}}}) == ("model.extra", "absent", 1)
    assert config_mismatch(None, recorded) is None  # an older checkpoint: nothing recorded (the state check remains)
