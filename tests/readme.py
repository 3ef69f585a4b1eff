"""The README's Python snippets ("Calling it"), run as printed against a running server: `loraplex up`
(tests/test_up.py) and `loraplex serve` (tests/engine/server/test_serve_cli.py) share this, so the same
text is proven against both."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
PRINTED_URL = 'base_url="http://127.0.0.1:8080/v1", api_key="lpx_..."'


def readme_snippets() -> list[str]:
    """The Python blocks of the README's "Calling it" section, in order (each may use what the ones before
    it defined, as in one session)."""
    text = README.read_text()
    section = text[text.index("## Calling it") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```\n", section, re.S)


# How much of a reply of the demo adapter, served with `serve`'s and `up`'s defaults, is capitals at least.
# In float32 it is ~100%; in bfloat16 + int4 (their default on a CPU that computes bfloat16 natively) a
# word or two of a reply may stay lowercase (89.9% seen on a Xeon with AMX, 2026-11-28). The base model's
# replies are under 10% capitals.
DEMO_CAPITALS = 0.8


def uppercase_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def run_readme_snippets(port: int, key: str, workdir: Path) -> str:
    """Runs the snippets as one script pointed at 127.0.0.1:`port` with API key `key`; checks that it
    exits cleanly (a usage-only chunk where a client did not ask for one breaks `chunk.choices[0]`), that
    the demo adapter answered, and that usage came exactly once, where asked. Returns what it printed."""
    snippets = readme_snippets()
    assert len(snippets) == 2 and PRINTED_URL in snippets[0]
    script = (
        "\n".join(snippets).replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace('"lpx_..."', repr(key))
    )
    path = workdir / "readme_snippets.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    streamed, asked = run.stdout.split("\n[")[0], run.stdout.count(" tokens]")
    assert asked == 1, run.stdout  # the second snippet's usage chunk, and only it
    assert re.search(r"\[\d+ \+ [1-9]\d* tokens\]\n$", run.stdout), run.stdout
    assert uppercase_share(streamed) >= DEMO_CAPITALS, run.stdout
    return run.stdout
