"""The first process of every pod, run by the kubelet as `ip netns exec <ns> python podinit.py <spec.json>`.

`ip netns exec` has already entered the pod's network namespace and a private mount namespace (mounts made
here do not leak to the host) with /etc/hosts bound to the pod's own file. This bind-mounts each volume
directory at its mountPath, as a container runtime would, then replaces itself with the container's command
under exactly the environment the kubelet resolved. Standard library only: it runs before anything else.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

# A container's /dev is a fresh tmpfs with the usual device nodes, so files a pod puts there (its
# termination log) never appear in the host's /dev, where other processes would see them.
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}


def private_dev() -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755,nosuid", "tmpfs", "/dev"], check=True)
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"/dev/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", 0o666)  # mknod's mode is masked by the umask
    os.mkdir("/dev/shm")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", "/dev/shm"], check=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"/dev/{name}")


def covers(target: str, path: str) -> bool:
    """Whether a volume mounted at `target` hides `path` (it is `path` or one of its folders)."""
    return os.path.commonpath([target, path]) == os.path.normpath(target)


def restore(path: str, fd: int) -> None:
    """Bind an image path back over the volume that hid it, as an image's own files stay visible.

    The mount point is made inside the volume; a read-only volume cannot hold one, and says so.
    """
    os.makedirs(path, exist_ok=True)
    subprocess.run(
        ["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", path], check=True, pass_fds=[fd]
    )


def main(spec_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    private_dev()
    # Every source is opened before anything is mounted: a volume at /tmp must not hide a source under /tmp.
    sources = [os.open(source, os.O_PATH) for source, _, _ in spec["mounts"]]
    image_paths = [(path, os.open(path, os.O_PATH)) for path in spec.get("image_paths", [])]
    for fd, (source, target, read_only) in zip(sources, spec["mounts"], strict=True):
        if target.startswith("/dev/") and not os.path.exists(target):  # inside the private /dev
            if os.path.isdir(source):
                os.makedirs(target)
            else:
                open(target, "w").close()
        subprocess.run(
            ["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", target], check=True, pass_fds=[fd]
        )
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
    targets = [target for _, target, _ in spec["mounts"]]
    for path, fd in image_paths:
        if any(covers(target, path) for target in targets):
            restore(path, fd)
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
