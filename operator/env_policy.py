"""Which environment variables `spec.podTemplate` may give the engine container.

The engine runs next to the internal token, so a variable that makes a program load code, or send its
traffic elsewhere, is as good as a shell in the pod. The rule, by name (the operator's own
variables are refused before this, in overlay.py):
- LORAPLEX_* names are allowed when the engine reads them (its other options), refused otherwise (a typo
  would vanish silently);
- a few names the engine's libraries read on purpose are allowed (ENGINE_READ: HF_TOKEN, HF_HUB_OFFLINE);
- anything else is allowed unless the deny-list below matches: loader and interpreter variables (PYTHON*,
  LD_*, PATH, HOME, TMPDIR, compilers and the Triton, Torch and CUDA caches, which hold shared objects
  that get loaded) and network variables (*_PROXY in any case, AWS_*ENDPOINT* and the AWS config files,
  HF_*, resolver aliases).
`envFrom` imports a ConfigMap's or Secret's keys, which the operator cannot see: it needs a `prefix` that
no refused name can start with. Pure: each check returns the reason or None.
"""

from __future__ import annotations

from loraplex.engine.options import ENV_PREFIX
from loraplex.operator.engine_args import engine_variables

# Read on purpose by the engine's libraries (engine/model/sources.py: hf:// models), so allowed although
# their family is denied.
ENGINE_READ = frozenset({"HF_TOKEN", "HF_HUB_OFFLINE"})
# Whole families, matched on the upper-cased name.
DENIED_PREFIXES = (
    "PYTHON",  # PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, PYTHONWARNINGS (imports a category's module)
    "LD_",  # LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT
    "HF_",  # HF_ENDPOINT redirects model downloads; HF_HOME swaps the cache
    "HUGGINGFACE_",
    "TRITON_",  # TRITON_CACHE_DIR holds launcher .so files it loads; TRITON_PTXAS_PATH runs a binary
    "TORCH",  # TORCHINDUCTOR_CACHE_DIR, TORCH_EXTENSIONS_DIR: compiled code that gets loaded
    "PYTORCH_",  # PYTORCH_KERNEL_CACHE_PATH
    "CUDA_",  # CUDA_HOME: where ptxas and friends are run from
    "NVIDIA_",  # NVIDIA_VISIBLE_DEVICES=all hands the pod every GPU of its node
    "XDG_",  # cache and config roots of the same libraries
    "AWS_CONTAINER_",  # credentials fetched from a URL
)
# Single names, matched on the upper-cased name.
DENIED_NAMES = frozenset(
    {
        "PATH",  # where `loraplex` itself is looked up
        "HOME",  # ~/.triton/cache
        "TMPDIR",  # torch's compile caches live under the temporary directory
        "TMP",
        "TEMP",
        "CC",  # Triton compiles its launcher with $CC
        "CXX",
        "GCONV_PATH",  # glibc loads iconv modules from there
        "LOCPATH",
        "HOSTALIASES",  # host name aliases: traffic elsewhere
        "LOCALDOMAIN",
        "RES_OPTIONS",
        "SSLKEYLOGFILE",  # TLS session keys written out
        "AWS_CONFIG_FILE",  # profiles carry endpoint_url and credential_process (a command)
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_DATA_PATH",  # botocore's service models, endpoints included
    }
)
# Schemes whose `<scheme>_proxy` urllib, requests, httpx and botocore use (any case).
PROXY_SCHEMES = ("http", "https", "all", "no", "ftp", "ws", "wss", "socks", "socks4", "socks5")


def env_problem(name: str) -> str | None:
    """Why the engine container may not have variable `name`; None when it may."""
    upper = name.upper()
    if name.startswith(ENV_PREFIX):
        if name in engine_variables():
            return None
        return "is not a variable `loraplex serve` reads (docs/configuration.md lists them)"
    if name in ENGINE_READ:
        return None
    if upper.endswith("_PROXY"):
        return (
            "would send the engine's traffic through a proxy (the internal token and store credentials too)"
        )
    if upper.startswith("AWS_") and "ENDPOINT" in upper:
        return (
            "would send the engine's store traffic elsewhere; the operator sets spec.adapterStore.endpointUrl"
        )
    denied = upper in DENIED_NAMES or upper.startswith(DENIED_PREFIXES)
    if denied:
        return "changes what code the engine loads or where its traffic goes (docs/operator.md, deny-list)"
    return None


def env_prefix_problem(prefix: str) -> str | None:
    """Why `envFrom` with this prefix could import a refused name; None when no such name starts with it."""
    if not prefix:
        return (
            "imports every key of the object as a variable, which the operator cannot check: give a prefix "
            "such as APP_"
        )
    upper = prefix.upper()
    # LORAPLEX_ and AWS_ cover the operator's own variables too.
    for stem in (ENV_PREFIX, "AWS_", *DENIED_PREFIXES):
        if stem.startswith(upper) or upper.startswith(stem):
            return f"could make {stem}* variables, which the operator refuses; choose a prefix such as APP_"
    for name in (*sorted(DENIED_NAMES), *(f"{scheme}_proxy".upper() for scheme in PROXY_SCHEMES)):
        if name.startswith(upper):
            return f"could make {name}, which the operator refuses; choose a prefix such as APP_"
    return None
