"""Copy crds/*.yaml into the Helm chart as templates, gated by crds.enabled and kept by crds.keep.

    python -m loraplex.operator.generate_chart_crds          # write
    python -m loraplex.operator.generate_chart_crds --check  # exit 1 when the chart copy is stale

crds/ is the one source; tests/operator/test_chart.py fails when the chart's copies drift from it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
TARGET = ROOT / "charts" / "loraplex" / "templates" / "crds"
_KEEP = "__loraplex_keep__"


def render(source: Path) -> str:
    """The chart template for one CRD file: the same object, wrapped in the crds.* switches."""
    crd = yaml.safe_load(source.read_text())
    annotations = crd["metadata"].setdefault("annotations", {})
    annotations["loraplex.dev/generated-from"] = f"crds/{source.name}"
    annotations[_KEEP] = "x"
    body = yaml.safe_dump(crd, sort_keys=False, width=110)
    keep = (
        "    {{- if .Values.crds.keep }}\n"
        "    # Uninstalling the chart must not delete every InferenceDeployment with the CRD.\n"
        "    helm.sh/resource-policy: keep\n"
        "    {{- end }}"
    )
    body = body.replace(f"    {_KEEP}: x", keep)
    command = "python -m loraplex.operator.generate_chart_crds"
    header = f"# Generated from crds/{source.name} by `{command}`; do not edit.\n"
    return f"{header}{{{{- if .Values.crds.enabled }}}}\n{body}{{{{- end }}}}\n"


def expected() -> dict[Path, str]:
    return {TARGET / source.name: render(source) for source in sorted(SOURCE.glob("*.yaml"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the chart copy is stale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = [path for path, text in expected().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            logger.error("%s is stale: run python -m loraplex.operator.generate_chart_crds", path)
        return 1 if stale else 0
    TARGET.mkdir(parents=True, exist_ok=True)
    for path, text in expected().items():
        path.write_text(text)
        logger.info("wrote %s", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
