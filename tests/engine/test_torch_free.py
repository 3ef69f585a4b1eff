"""The scheduler, the pool, the adapter registry and the adapter report are bookkeeping: no torch, no file
access.

Proved in a fresh interpreter where importing torch fails and an audit hook refuses every file open or
directory read once the modules are imported: a workload of scheduling (chunked prefill, preemption,
adapter loads, eviction, a refused adapter, an unregistered one draining) and postprocessing runs there.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

WORKLOAD = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "safetensors", "triton"):
                raise ImportError(f"{name} may not be imported here")
            return None

    sys.meta_path.insert(0, NoTorch())

    from types import SimpleNamespace

    from loraplex.engine.lora.registry import AdapterRegistry
    from loraplex.engine.lora.report import adapter_report
    from loraplex.engine.pool import PagePool
    from loraplex.engine.request import Request
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.scheduler import Scheduler
    from loraplex.engine.stopping import StopChecker

    class Source:
        manifest = SimpleNamespace(sha256="0" * 64, ranks=(4,))

    armed = False
    touched = []

    def no_files(event, args):
        if armed and (event in ("open", "os.listdir", "os.scandir") or event.startswith("shutil.")):
            touched.append((event, args[:1]))
            raise PermissionError(f"{event} during scheduling: {args[:1]}")

    sys.addaudithook(no_files)

    pool = PagePool(24)
    registry = AdapterRegistry(pool, max_resident=2)
    for name in ("a", "b", "c", "bad", "gone"):
        registry.register(name, Source(), num_pages=3)
    scheduler = Scheduler(pool, 4, 4, 16, registry, stop=StopChecker([2], max_model_len=64))
    adapters = [None, "a", "b", "c", "a", None, "bad", "gone"]
    requests = [
        Request(f"r{i}", list(range(3, 3 + 5 + 3 * i)), SamplingParams(max_tokens=6), i, adapter=a)
        for i, a in enumerate(adapters)
    ]
    armed = True
    for request in requests:
        scheduler.add(request)
    registry.mark_failed("bad", "refused")
    registry.unregister("gone")
    steps = preempted = loads = reported = 0
    host = SimpleNamespace(packed_names=lambda: ["c"])  # the host cache's bookkeeping, without its packs
    loader = SimpleNamespace(take_load_times=lambda: ())
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        reported += bool(adapter_report(scheduler, registry, host, loader).running)
        for load in plan.adapter_loads:
            registry.loaded(load.name)
        loads += len(plan.adapter_loads)
        preempted += len(plan.preempted)
        scheduler.postprocess(plan, [5] * len(plan.sampling))
        steps += 1
        assert steps < 1000
    armed = False
    assert not touched, touched
    reasons = [r.finish_reason for r in requests]
    assert reasons == ["length"] * 6 + ["error", "length"], reasons
    assert registry.entry("gone") is None and registry.evictions > 0 and loads > 3 and reported > 0
    print("torch" in sys.modules, preempted > 0)
    """
)


def test_scheduling_imports_no_torch_and_touches_no_file() -> None:
    run = subprocess.run([sys.executable, "-c", WORKLOAD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]  # no torch, and the workload did preempt
