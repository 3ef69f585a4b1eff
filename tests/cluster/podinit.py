"""The first process of every pod, run by the kubelet as `ip netns exec <ns> python podinit.py <spec.json>`.

`ip netns exec` has already entered the pod's network namespace and a private mount namespace (mounts made
here do not leak to the host) with /etc/hosts bound to the pod's own file. This bind-mounts each volume
directory at its mountPath, as a container runtime would, then replaces itself with the container's command
under exactly the environment the kubelet resolved. Standard library only: it runs before anything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(spec_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    # Every source is opened before anything is mounted: a volume at /tmp must not hide a source under /tmp.
    sources = [os.open(source, os.O_PATH) for source, _, _ in spec["mounts"]]
    for fd, (_, target, read_only) in zip(sources, spec["mounts"], strict=True):
        subprocess.run(["mount", "--bind", f"/proc/self/fd/{fd}", target], check=True, pass_fds=[fd])
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
    os.chdir(spec["cwd"])
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as error:
        # What a runtime reports as StartError; the kubelet shows this line as the termination message.
        print(f"exec {argv[0]!r} failed: {error}", file=sys.stderr)
        with open(spec["termination_target"], "w") as log:
            log.write(f"exec {argv[0]!r} failed: {error}")
        sys.exit(128)


if __name__ == "__main__":
    main(sys.argv[1])
