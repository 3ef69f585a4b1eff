"""Loaded beside the operator (`kopf run -m loraplex.operator.main -m tests.operator.kopf_in_emulator`) when
a test runs the operator as its own process against tests/operator's API emulator.

kmock cannot serve the cluster-scoped namespace list kopf scans when given `--namespace`: scanning is off,
so kopf takes the given namespaces as they are. Its one-off discovery of API resources still runs, which is
how it finds the peering kind.
"""

from __future__ import annotations

from typing import Any

import kopf


@kopf.on.startup()
def no_namespace_scanning(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.scanning.disabled = True
