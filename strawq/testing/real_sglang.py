"""The real SGLang server as a test and benchmark fixture, and the bracket scenario run on it.

* :func:`start_real_server` starts the project's CPU fixture (SGLang 0.5.23 serving
  SmolLM2-135M, built by ``deploy/sglang/cpu_fixture.sh build``, started by its ``serve``)
  on a free port with ``--weight-version 0`` and API keys, and stops it.
* :func:`make_perturbed_copy` makes the second weight directory: the model with one tensor
  scaled, so that a weight update is a real change.
* :func:`bracket_scenario` runs a producer (G samples per group) across weight-update
  brackets (pause producers → ``push_weights`` → resume) and reports the tokens kept, the
  tokens generated and each bracket's latency. The real-tier end-to-end test and
  ``bench/engines.py`` both run it.

Nothing here is used in production.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MODEL_NAME = "smollm2-135m-instruct-bf16"
PERTURBED_TENSOR = "model.norm.weight"
# "The capital of France is" and another short prompt (SmolLM2 ids)
PROMPTS = ([504, 3575, 282, 4649, 314], [11443, 2402, 253, 655])


@dataclass
class RealServer:
    """A running real server (``pid`` None: started by someone else)."""

    url: str
    model_dir: str
    perturbed_dir: str
    api_key: str | None = None
    admin_api_key: str | None = None
    started_s: float = 0.0
    pid: int | None = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop a server this process started (its whole process group)."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _stop(producer: Any, task: asyncio.Task[Any]) -> None:
    """Ask a scenario's producer to stop, wait for it (60 s), re-raise what it died of."""
    producer.request_stop()
    await asyncio.wait([task], timeout=60)
    if task.done() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def _wait(cond: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll ``cond`` every 50 ms; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s:.0f}s")
        await asyncio.sleep(0.05)

def default_tools_dir() -> Path:
    """``$STRAWQ_SGLANG_TOOLS``, else the checkout's ``deploy/sglang`` (the fixture builder)."""
    explicit = os.environ.get("STRAWQ_SGLANG_TOOLS")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().parents[2] / "deploy" / "sglang"


def default_fixture_home() -> Path:
    """``$SGLANG_CPU_HOME``, else ``~/.cache/sglang-cpu`` (outside any checkout)."""
    return Path(os.environ.get("SGLANG_CPU_HOME") or Path.home() / ".cache" / "sglang-cpu")


def fixture_problem(home: Path, tools: Path) -> str | None:
    """Why a server cannot be started from ``home`` / ``tools`` (None: it can)."""
    if not (tools / "cpu_fixture.sh").exists():
        return (f"{tools / 'cpu_fixture.sh'} not found (run from a checkout, or set "
                "STRAWQ_SGLANG_TOOLS to its deploy/sglang)")
    if not (home / "venv" / "bin" / "python").exists():
        return f"the CPU fixture is not built in {home} (deploy/sglang/cpu_fixture.sh build)"
    if not (home / "model" / MODEL_NAME / "config.json").exists():
        return f"no model in {home / 'model' / MODEL_NAME}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_perturbed_copy(model_dir: Path, out: Path, *, scale: float = 1.05) -> Path:
    """Copy ``model_dir`` to ``out`` with ``PERTURBED_TENSOR`` (bf16) multiplied by ``scale``.

    Pure numpy on the safetensors layout (8-byte header length, JSON header, raw data).
    Idempotent: a complete copy is reused.
    """
    if (out / ".strawq-perturbed").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    raw = bytearray((model_dir / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    entry = header[PERTURBED_TENSOR]
    if entry["dtype"] != "BF16":
        raise ValueError(f"{PERTURBED_TENSOR} is {entry['dtype']}, expected BF16")
    start, end = (8 + n + int(x) for x in entry["data_offsets"])
    bits = np.frombuffer(bytes(raw[start:end]), dtype=np.uint16).astype(np.uint32) << 16
    values = bits.view(np.float32) * np.float32(scale)
    raw[start:end] = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    (tmp / "model.safetensors").write_bytes(bytes(raw))
    (tmp / ".strawq-perturbed").write_text(f"{PERTURBED_TENSOR} x {scale}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def start_real_server(
    home: Path | None = None,
    tools: Path | None = None,
    *,
    api_key: str | None = "strawq-test-key",
    admin_api_key: str | None = "strawq-test-admin-key",
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> RealServer:
    """Start the CPU fixture's server on a free port; raises ``RuntimeError`` saying why not."""
    home = home or default_fixture_home()
    tools = tools or default_tools_dir()
    problem = fixture_problem(home, tools)
    if problem:
        raise RuntimeError(problem)
    model_dir = home / "model" / MODEL_NAME
    perturbed = make_perturbed_copy(model_dir, home / "model" / (MODEL_NAME + "-perturbed"))
    port = free_port()
    args = ["--weight-version", "0", *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    if admin_api_key:
        args += ["--admin-api-key", admin_api_key]
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(tools / "cpu_fixture.sh"), "serve", str(port), "--", *args],
        env=dict(os.environ, SGLANG_CPU_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0 or not proc.stdout.strip().isdigit():
        raise RuntimeError(f"cpu_fixture.sh serve failed (rc {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return RealServer(
        url=f"http://127.0.0.1:{port}",
        model_dir=str(model_dir),
        perturbed_dir=str(perturbed),
        api_key=api_key,
        admin_api_key=admin_api_key,
        started_s=time.monotonic() - t0,
        pid=int(proc.stdout.strip()),
    )


@dataclass
class BracketResult:
    kept: int  # response tokens in the ready groups
    generated: int  # tokens the producer received from the engines
    lost_requests: int  # requests cancelled because they never came back
    latencies_s: list[float]  # pause written -> resume written, per bracket
    groups: dict[str, Any] = field(default_factory=dict)
    queue: Any = None
    run_dir: str = ""

    @property
    def kept_ratio(self) -> float:
        return self.kept / self.generated if self.generated else float("nan")


def get_json(url: str, key: str | None = None) -> dict[str, object]:
    """GET ``url`` (bearer ``key``), a JSON object or ``ValueError``."""
    import urllib.request

    req = urllib.request.Request(url)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    if not isinstance(body, dict):
        raise ValueError(f"{url} did not return an object")
    return body


class RouterProcess:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def start_router(
    cmd: list[str],
    worker_urls: list[str],
    *,
    timeout_s: float = 60.0,
    log: Path | None = None,
    extra_args: tuple[str, ...] = (),
    api_key: str | None = None,
) -> RouterProcess:
    """Start the real router in front of ``worker_urls``; returns once ``GET /workers`` lists
    them all. With ``api_key`` the router is started with ``--api-key``: it then wants that
    key from its clients and sends it to the workers."""
    if api_key:
        extra_args = (*extra_args, "--api-key", api_key)
    port = free_port()
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        # its Prometheus exporter gets a port of its own too: the router's default, 29000, is
        # taken by any other router on the machine, and it then panics at start
        [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warn",
         *extra_args, "--worker-urls", *worker_urls],
        stdout=out, stderr=subprocess.STDOUT,
    )
    router = RouterProcess(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body = get_json(router.url + "/workers", api_key)
            workers = body.get("workers")
            if isinstance(workers, list) and len(workers) >= len(worker_urls):
                return router
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(
                f"sglang-router did not list {len(worker_urls)} workers within {timeout_s:.0f}s "
                f"(exit code {proc.poll()})"
            )
        time.sleep(0.2)


def bracket_scenario(
    server: RealServer,
    workdir: Path,
    *,
    groups: int = 2,
    group_size: int = 2,
    max_new: int = 48,
    brackets: int = 2,
    router_url: str | None = None,
    settle_s: float = 0.8,
    timeout_s: float = 300.0,
) -> BracketResult:
    """A producer across ``brackets`` weight updates; version v loads the perturbed
    weights for odd v and the original ones for even v (each a real change)."""
    from strawq.config import QueueConfig
    from strawq.data.dataset import Dataset
    from strawq.data.feeder import Feeder
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        BudgetConfig,
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
        SamplerParams,
        TimingConfig,
    )
    from strawq.producers.sglang_client import ClientConfig, SGLangClient
    from strawq.storage import PosixStorage
    from strawq.tasks.queue import RunQueue
    from strawq.weights.control import Control

    run_dir = workdir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    q = RunQueue.create(
        PosixStorage(str(run_dir), writer_id="setup", fsync=False),
        QueueConfig(fsync=False, lease_timeout_s=30.0, heartbeat_interval_s=0.2,
                    group_size=group_size, release_batch=groups),
    )
    data = run_dir / "dataset.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "target": 7, "count": 3}) + "\n"
        for i in range(groups)))
    Feeder(q, Dataset(str(data))).release(groups)
    control = Control(q.storage)
    cfg = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key,
                       max_retries=1)
    p = Producer(ProducerConfig(
        run_dir=str(run_dir),
        engine=EngineConfig(workers=() if router_url else (server.url,), router_url=router_url,
                            client=cfg),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=max_new, ignore_eos=True, seed=1),
        budget=BudgetConfig(slots=groups),
        timing=TimingConfig(control_poll_s=0.05, idle_poll_s=0.05)))
    latencies: list[float] = []

    def ready() -> int:
        return len(q.storage.list("ready"))

    async def wait(cond: Any, what: str) -> None:
        await _wait(cond, f"bracket scenario: {what}", timeout_s)

    async def body() -> None:
        async with SGLangClient([server.url], config=cfg) as trainer:
            for v in range(1, brackets + 1):
                await wait(lambda: p.stats().busy_trajectories > 0 or ready() == groups,
                           "generating")
                await asyncio.sleep(settle_s)
                t0 = time.monotonic()
                control.pause(v)
                await wait(lambda: p.producer_id in control.state().acks, "the ack")
                await trainer.push_weights(
                    server.perturbed_dir if v % 2 else server.model_dir, weight_version=v)
                q.set_version(v)
                control.resume(v)
                latencies.append(time.monotonic() - t0)
        await wait(lambda: ready() == groups, "all groups ready")

    async def main() -> None:
        async with SGLangClient([server.url], config=cfg) as c:
            await c.push_weights(server.model_dir, weight_version=0)  # a known start
        task = asyncio.create_task(p.run())
        try:
            await body()
        finally:
            await _stop(p, task)

    asyncio.run(main())
    from strawq.ondisk.names import TaskName

    found: dict[str, Any] = {}
    for name in q.storage.list("ready"):
        t = TaskName.try_parse(name)
        if t is not None:
            found[t.id] = q.read_group(t.id, t.gen)
    kept = sum(int(sum(g.sample_lens)) for g in found.values())
    return BracketResult(kept=kept, generated=p.stats().tokens_generated,
                         lost_requests=p._aborter.lost_requests, latencies_s=latencies,
                         groups=found, queue=q, run_dir=str(run_dir))


@dataclass
class StaleEngineResult:
    #: ready groups generated while the engine was out of rotation (must be 0)
    ready_while_stale: int
    #: the producer noted the engine for the trainer and waited for weights
    noted: bool
    waited: bool
    #: the URLs the trainer's repair pushed
    repaired: list[str]
    groups: dict[str, Any] = field(default_factory=dict)
    run_version: int = 0


def stale_engine_scenario(server: RealServer, workdir: Path, *, groups: int = 2,
                          group_size: int = 2, max_new: int = 16,
                          timeout_s: float = 300.0) -> StaleEngineResult:
    """The server holds version ``w`` while the run is at ``w + 1`` (as after a restart with
    an old ``--weight-version``, or a push it missed): the producer must keep it out of
    rotation and generate nothing, note it in ``engines/``; the trainer's repair (the
    ``push_weights`` of every update, limited to that engine) brings it back."""
    from strawq.collector.trainer.bracket import WeightUpdateBracket
    from strawq.config import QueueConfig
    from strawq.data.dataset import Dataset
    from strawq.data.feeder import Feeder
    from strawq.ondisk.names import TaskName
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        BudgetConfig,
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
        SamplerParams,
        TimingConfig,
    )
    from strawq.producers.sglang_client import ClientConfig, SGLangClient
    from strawq.storage import PosixStorage
    from strawq.tasks.queue import RunQueue

    cfg = ClientConfig(api_key=server.api_key, admin_api_key=server.admin_api_key,
                       max_retries=1)

    async def engine_version() -> int:
        async with SGLangClient([server.url], config=cfg) as c:
            return await c.weight_version(server.url)

    run_dir = workdir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    q = RunQueue.create(
        PosixStorage(str(run_dir), writer_id="setup", fsync=False),
        QueueConfig(fsync=False, lease_timeout_s=30.0, heartbeat_interval_s=0.2,
                    group_size=group_size, release_batch=groups))
    run_version = asyncio.run(engine_version()) + 1
    q.set_version(run_version)
    data = run_dir / "dataset.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "target": 7, "count": 3}) + "\n"
        for i in range(groups)))
    Feeder(q, Dataset(str(data))).release(groups)
    p = Producer(ProducerConfig(
        run_dir=str(run_dir),
        engine=EngineConfig(workers=(server.url,), client=cfg),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=max_new, ignore_eos=True, seed=1),
        budget=BudgetConfig(slots=groups),
        timing=TimingConfig(control_poll_s=0.05, idle_poll_s=0.05)))

    def push_to(urls: list[str], version: int) -> None:
        async def go() -> None:
            async with SGLangClient(urls, config=cfg) as c:
                await c.push_weights(server.model_dir, weight_version=version)
        asyncio.run(go())

    bracket = WeightUpdateBracket(q, repair=push_to, repair_interval_s=None)
    result = StaleEngineResult(0, False, False, [], run_version=run_version)

    async def wait(cond: Any, what: str) -> None:
        await _wait(cond, f"stale-engine scenario: {what}", timeout_s)

    async def main() -> None:
        task = asyncio.create_task(p.run())
        try:
            await wait(lambda: server.url in bracket.engines_needing_weights(), "the note")
            await wait(lambda: p.stats().waiting_for_weights, "waiting for weights")
            await asyncio.sleep(1.0)  # a producer that ignored the note would generate now
            result.noted, result.waited = True, True
            result.ready_while_stale = len(q.storage.list("ready"))
            result.repaired = await asyncio.to_thread(bracket.repair_engines)
            await wait(lambda: len(q.storage.list("ready")) == groups, "all groups ready")
        finally:
            await _stop(p, task)

    asyncio.run(main())
    for name in q.storage.list("ready"):
        t = TaskName.try_parse(name)
        if t is not None:
            result.groups[t.id] = q.read_group(t.id, t.gen)
    return result
