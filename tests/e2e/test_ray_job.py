"""Ray clusters, for real, on one machine: the commands of the README's "Ray cluster" section.

* a head (`ray start --head`) and a second Ray node process joining it (`ray start --address`), each
  with its own CPU, token authentication on (`RAY_AUTH_MODE=token` with a shared `RAY_AUTH_TOKEN`),
  the project's venv first on PATH (so a job's `python` is the venv's);
* `ray job submit --working-dir . -- python -m rlsp.main ...` succeeds, writes its metrics, and places
  one worker on each node (an sp group never spans nodes);
* `trainer.ray_address=auto` joins that cluster; with it unset a run starts a private local Ray beside
  the live cluster (ignoring its address file and RAY_ADDRESS), and a stale address file left by a
  dead head does not get in the way either.

The cluster is ended by the PIDs it started (every process carrying the test's marker in its
environment): `ray stop` would stop every Ray on the machine, other people's included.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import pytest
from test_faults import _cmdline, _marked

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
MARK = "RLSP_FAULT_TEST"  # test_faults._marked finds the processes that carry it in their environment
# The HF rollout engine keeps start-up short (the vLLM path is covered by test_grpo_e2e.py).
RUN = ["actor_rollout_ref.rollout.name=hf", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
       "trainer.device=cpu", "trainer.test_freq=0", "trainer.save_final_model=false", "trainer.plot=false"]
# Only ends a hung test: a run of 1-2 tiny steps, on a 2x slower machine with its cores shared, can take minutes.
RUN_TIMEOUT_S = 600
# Two workers per node in sp groups of 2: each group must sit on one node.
TWO_NODES = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2",
             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.total_training_steps=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_and_wait(pids: list[int], sig: int, wait_s: float, marker: str) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while set(pids) & set(_marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)


def _stop(marker: str) -> dict[int, str]:
    """What `ray stop` does, for this test's processes only: raylets first, then everything else, the
    GCS last; SIGTERM, then SIGKILL after a grace period. Returns what is still alive (nothing)."""
    def bucket(pid: int) -> int:
        exe = os.path.basename(_cmdline(pid).split(" ")[0])
        return 0 if exe == "raylet" else 2 if exe == "gcs_server" else 1

    for b in (0, 1, 2):
        pids = [pid for pid in _marked(marker) if bucket(pid) == b]
        _signal_and_wait(pids, signal.SIGTERM, 5.0, marker)
        # after SIGKILL: waits only until they are gone; generous, so a busy machine is not "left behind"
        _signal_and_wait([p for p in pids if p in _marked(marker)], signal.SIGKILL, 30.0, marker)
    _signal_and_wait(_marked(marker), signal.SIGKILL, 30.0, marker)  # anything started meanwhile
    return {pid: _cmdline(pid) for pid in _marked(marker)}


def _env(temp: str, marker: str, **extra: str) -> dict[str, str]:
    """A clean shell with the venv active; Ray's temp dir (address file, sessions) under `temp`."""
    # `import rlsp.main` in this process (other tests) sets Ray's single-node switch: not for `ray start`.
    dropped = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": os.path.dirname(VENV_BIN),
            "RAY_TMPDIR": temp, MARK: marker, **extra}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@dataclass
class Cluster:
    env: dict[str, str]
    gcs: str  # <ip>:<port> of the head
    dashboard: str  # what `ray job submit --address` takes


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def cluster():
    marker = uuid.uuid4().hex
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    env = _env(temp, marker, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    port, dashboard = _free_port(), _free_port()
    try:
        head = _run(["ray", "start", "--head", f"--port={port}", "--num-cpus=2", '--resources={"rlsp_head": 1}',
                     "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                     f"--dashboard-agent-listen-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
                     "--disable-usage-stats"], env, 180)
        assert head.returncode == 0, head.stdout[-3000:] + head.stderr[-3000:]
        with open(os.path.join(temp, "ray", "ray_current_cluster")) as f:
            gcs = f.read().strip()
        node = _run(["ray", "start", f"--address={gcs}", "--num-cpus=2", '--resources={"rlsp_second": 1}',
                     f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats"], env, 180)
        assert node.returncode == 0, node.stdout[-3000:] + node.stderr[-3000:]
        yield Cluster(env, gcs, f"http://127.0.0.1:{dashboard}")
    finally:
        left = _stop(marker)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"cluster processes left behind: {left}"


def _state(cluster: Cluster, kind: str, *args: str) -> list[dict]:
    out = _run(["ray", "list", kind, f"--address={cluster.dashboard}", "--format=json", "--detail", "--limit=10000",
                *args], cluster.env, 60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_job_submit_runs_on_both_nodes(cluster, cache_dir, tmp_path):
    run_dir, sid = tmp_path / "run", f"rlsp-test-{uuid.uuid4().hex[:8]}"
    job = _run(["ray", "job", "submit", f"--address={cluster.dashboard}", f"--submission-id={sid}", "--working-dir=.",
                "--", "python", "-m", "rlsp.main", *RUN, *TWO_NODES, f"trainer.default_local_dir={run_dir}",
                f"trainer.cache_dir={cache_dir}"], cluster.env, RUN_TIMEOUT_S)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    status = _run(["ray", "job", "status", f"--address={cluster.dashboard}", sid], cluster.env, 60)
    assert f"Job '{sid}' succeeded" in status.stdout, status.stdout + status.stderr
    assert "joined the Ray cluster at" in job.stdout and "run complete: 2 steps" in job.stdout, job.stdout[-3000:]
    assert "sp self-check passed" in job.stdout
    assert "(WorkerProcess pid=" not in job.stdout and "(WorkerProcess pid=" in (run_dir / "run.log").read_text(), job.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"]) for r in records)
    # Placement: two workers on each node, and each sp group of 2 ranks on one node.
    nodes = {n["node_id"]: n for n in _state(cluster, "nodes")}
    ours = {nid for nid, n in nodes.items() if {"rlsp_head", "rlsp_second"} & set(n["resources_total"])}
    assert len(ours) == 2, nodes
    workers = [a for a in _state(cluster, "actors", "--filter=class_name=WorkerProcess")
               if a["name"].startswith("rlsp-policy-")]
    node_of = {int(a["name"].split("-")[2]): a["node_id"] for a in workers}
    assert sorted(node_of) == [0, 1, 2, 3] and set(node_of.values()) == ours, workers
    assert node_of[0] == node_of[1] and node_of[2] == node_of[3], node_of


# A custom reward that records, in the process that scores, what verl's ray_kwargs.ray_init.runtime_env.env_vars set.
SEEN_REWARD = """import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["RLSP_E2E_SEEN"], "a") as f:
        f.write(os.environ["RLSP_E2E_VALUE"] + "\\n")
    return 0.0
"""


def test_auto_joins_the_running_cluster(cluster, cache_dir, tmp_path):
    """Also: ray_kwargs.ray_init.runtime_env.env_vars reach the joined cluster's job (its scoring processes)."""
    (tmp_path / "reward.py").write_text(SEEN_REWARD)
    seen = tmp_path / "seen.txt"
    proc = _run([sys.executable, "-m", "rlsp.main", *RUN, "trainer.total_training_steps=1", "trainer.ray_address=auto",
                 f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={cache_dir}",
                 f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=compute_score",
                 f"+ray_kwargs.ray_init.runtime_env.env_vars.RLSP_E2E_SEEN={seen}",
                 "+ray_kwargs.ray_init.runtime_env.env_vars.RLSP_E2E_VALUE=from-ray-kwargs"], cluster.env,
                RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"joined the Ray cluster at {cluster.gcs}: 2 nodes" in proc.stderr, proc.stderr[-3000:]
    assert "private local Ray" not in proc.stderr
    lines = seen.read_text().split()
    assert lines and set(lines) == {"from-ray-kwargs"}, lines  # every scored sample saw the job's env_vars


def test_unset_address_starts_a_private_ray_beside_a_live_cluster(cluster, cache_dir, tmp_path):
    # The live cluster's address file is where Ray looks, and RAY_ADDRESS points at it too.
    env = {**cluster.env, "RAY_ADDRESS": cluster.gcs}
    proc = _run([sys.executable, "-m", "rlsp.main", *RUN, "trainer.total_training_steps=1",
                 f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={cache_dir}"], env, RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "started a private local Ray (127.0.0.1:" in proc.stderr, proc.stderr[-3000:]
    assert f"RAY_ADDRESS={cluster.gcs} is ignored" in proc.stderr
    assert "joined the Ray cluster" not in proc.stderr


def test_stale_address_file_of_a_dead_head(cache_dir, tmp_path):
    marker = uuid.uuid4().hex
    temp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    try:
        os.makedirs(os.path.join(temp, "ray"))
        with open(os.path.join(temp, "ray", "ray_current_cluster"), "w") as f:
            f.write(f"127.0.0.1:{_free_port()}")  # a head that died without `ray stop`
        proc = _run([sys.executable, "-m", "rlsp.main", *RUN, "trainer.total_training_steps=1",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={cache_dir}"],
                    _env(temp, marker), RUN_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "started a private local Ray" in proc.stderr and "run complete: 1 step " in proc.stderr
        # The run stops its private Ray before it exits: nothing should be left at all. A process still
        # ending is given 60 s (the loop ends as soon as none is left), however busy the machine.
        deadline = time.monotonic() + 60
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in _marked(marker)}
        assert not left, f"the run left its private Ray behind: {left}"
    finally:
        _stop(marker)
        shutil.rmtree(temp, ignore_errors=True)
