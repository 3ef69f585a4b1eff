"""Base model sources: s3:// against a real S3-protocol server (moto, started here), hf:// offline from a
cache built here, and the one-line error (also in the termination log) when a URI does not resolve."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from loraplex.cli.main import main as loraplex_main
from loraplex.engine.model import sources
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.sources import ModelSourceError, fetch_model, parse_hf, parse_s3, served_name
from loraplex.engine.server.settings import ServerSettings

from .test_loaders import tiny_hf_model, write_gguf

BUCKET = "models"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_client(s3_endpoint: str) -> Any:
    import boto3

    client = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def s3(s3_endpoint: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The bucket's client, with the engine pointed at the same server through the environment."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "LORAPLEX_S3_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    return s3_client


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory, _ = tiny_hf_model(tmp_path_factory.mktemp("tiny"))
    return Path(directory)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplex.engine.model.hf_loader import load_hf_directory

    config, weights = load_hf_directory(tiny_dir)
    path = tmp_path_factory.mktemp("gguf") / "tiny-model.gguf"
    state = {name: torch.as_tensor(tensor) for name, tensor in dict(weights).items()}
    write_gguf(path, state, config)
    return path


def upload_folder(s3: Any, directory: Path, prefix: str) -> None:
    for file in sorted(directory.iterdir()):
        s3.upload_file(str(file), BUCKET, f"{prefix}/{file.name}")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours, theirs = dict(a.named_parameters()), dict(b.named_parameters())
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def leftovers(cache: Path) -> list[Path]:
    return [p for p in (cache / "s3").glob(".*")] if (cache / "s3").exists() else []


# --- s3:// ----------------------------------------------------------------------------------------------


def test_s3_folder_loads_the_same_model_and_is_reused(s3: Any, tiny_dir: Path, tmp_path: Path) -> None:
    upload_folder(s3, tiny_dir, "llama/tiny")
    cache = tmp_path / "cache"
    remote = load_model("s3://models/llama/tiny/", model_cache=cache)
    local = load_model(tiny_dir)
    assert same_weights(remote.model, local.model)
    entry = Path(fetch_model("s3://models/llama/tiny/", cache))
    assert entry.is_dir() and (entry / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    manifest = json.loads((entry / sources.MANIFEST).read_text())
    assert manifest["uri"] == "s3://models/llama/tiny/" and set(manifest["files"]) == {
        p.name for p in tiny_dir.iterdir()
    }
    # Re-used on the next start: the same files, not downloaded again.
    inodes = {p.name: p.stat().st_ino for p in entry.iterdir()}
    assert Path(fetch_model("s3://models/llama/tiny/", cache)) == entry
    assert {p.name: p.stat().st_ino for p in entry.iterdir()} == inodes
    # A key with no object but objects under it is the same folder.
    assert Path(fetch_model("s3://models/llama/tiny", cache)).is_dir()
    assert leftovers(cache) == []


def test_s3_reuses_the_cache_when_the_bucket_is_unreachable(
    s3: Any, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload_folder(s3, tiny_dir, "llama/tiny")
    cache = tmp_path / "cache"
    entry = fetch_model("s3://models/llama/tiny/", cache)
    monkeypatch.setenv("LORAPLEX_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    assert fetch_model("s3://models/llama/tiny/", cache) == entry
    with pytest.raises(ModelSourceError, match=r"^cannot read s3://models/other/: "):
        fetch_model("s3://models/other/", cache)


def test_s3_single_gguf_object_verified_by_sha256_metadata(s3: Any, tiny_gguf: Path, tmp_path: Path) -> None:
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    s3.upload_file(str(tiny_gguf), BUCKET, "gguf/tiny-model.gguf", ExtraArgs={"Metadata": {"sha256": digest}})
    cache = tmp_path / "cache"
    entry = Path(fetch_model("s3://models/gguf/tiny-model.gguf", cache))
    assert entry.name == "tiny-model.gguf" and entry.read_bytes() == tiny_gguf.read_bytes()
    assert same_weights(load_model(entry).model, load_model(tiny_gguf).model)
    assert served_name("s3://models/gguf/tiny-model.gguf") == "tiny-model"


def test_s3_wrong_sha256_metadata_is_refused_and_leaves_nothing(
    s3: Any, tiny_gguf: Path, tmp_path: Path
) -> None:
    s3.upload_file(str(tiny_gguf), BUCKET, "gguf/bad.gguf", ExtraArgs={"Metadata": {"sha256": "0" * 64}})
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match=r"s3://models/gguf/bad.gguf: sha256 [0-9a-f]{64} is not the"):
        fetch_model("s3://models/gguf/bad.gguf", cache)
    assert [p.name for p in (cache / "s3").iterdir()] == []  # no half model, no staging folder


def test_s3_sidecar_checksum(s3: Any, tiny_gguf: Path, tmp_path: Path) -> None:
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    s3.upload_file(str(tiny_gguf), BUCKET, "side/ok.gguf")
    s3.put_object(Bucket=BUCKET, Key="side/ok.gguf.sha256", Body=f"{digest}  ok.gguf\n".encode())
    assert (
        Path(fetch_model("s3://models/side/ok.gguf", tmp_path / "a")).read_bytes() == tiny_gguf.read_bytes()
    )
    s3.upload_file(str(tiny_gguf), BUCKET, "side/bad.gguf")
    s3.put_object(Bucket=BUCKET, Key="side/bad.gguf.sha256", Body=b"f" * 64)
    with pytest.raises(ModelSourceError, match="sha256"):
        fetch_model("s3://models/side/bad.gguf", tmp_path / "b")
    s3.put_object(Bucket=BUCKET, Key="side/junk.gguf", Body=b"x")
    s3.put_object(Bucket=BUCKET, Key="side/junk.gguf.sha256", Body=b"not a digest")
    with pytest.raises(ModelSourceError, match="does not start with a sha256"):
        fetch_model("s3://models/side/junk.gguf", tmp_path / "c")


def test_s3_etag_md5_catches_a_corrupted_download(
    s3: Any, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import botocore.response

    upload_folder(s3, tiny_dir, "llama/tiny")
    real_iter = botocore.response.StreamingBody.iter_chunks

    def flipped(self: Any, chunk_size: int = 1024) -> Iterator[bytes]:
        """One bit flipped on the wire: the body no longer has the object's MD5 (its ETag)."""
        for index, chunk in enumerate(real_iter(self, chunk_size)):
            yield (
                chunk[:10] + bytes([chunk[10] ^ 1]) + chunk[11:] if index == 0 and len(chunk) > 10 else chunk
            )

    monkeypatch.setattr(botocore.response.StreamingBody, "iter_chunks", flipped)
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="does not match its ETag"):
        fetch_model("s3://models/llama/tiny/", cache)
    assert [p.name for p in (cache / "s3").iterdir()] == []


def test_s3_unverifiable_object_is_refused(s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="multi/model.gguf", Body=b"GGUF")
    remote = sources.RemoteFile("multi/model.gguf", "model.gguf", 4, "0123456789abcdef0123456789abcdef-3")
    with pytest.raises(ModelSourceError, match=r"cannot be verified.*x-amz-meta-sha256"):
        sources._expected_checksum(s3, BUCKET, remote)


def test_s3_changed_object_is_downloaded_again_and_swapped_whole(
    s3: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    upload_folder(s3, tiny_dir, "changing/tiny")
    cache = tmp_path / "cache"
    entry = Path(fetch_model("s3://models/changing/tiny/", cache))
    config = json.loads((tiny_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    s3.put_object(Bucket=BUCKET, Key="changing/tiny/config.json", Body=json.dumps(config).encode())
    assert Path(fetch_model("s3://models/changing/tiny/", cache)) == entry
    assert json.loads((entry / "config.json").read_text())["rms_norm_eps"] == 1e-6
    assert leftovers(cache) == []


def test_s3_missing_and_malformed(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"^nothing at s3://models/nope: no such object"):
        fetch_model("s3://models/nope", tmp_path)
    for bad in [
        "s3://",
        "s3://models",
        "s3://models/",
        "s3://models/a/../b",
        "s3://Bad_Bucket/x",
        "s3://models/x?y=1",
    ]:
        with pytest.raises(ModelSourceError):
            parse_s3(bad)
    with pytest.raises(ValidationError, match="model"):
        ServerSettings(model="s3://models/a/../b")


# --- hf:// ----------------------------------------------------------------------------------------------


def hf_cache(cache: Path, repo_id: str, files: Path, revision: str = "main") -> str:
    """The layout huggingface_hub leaves after a download: refs/<revision> -> snapshots/<commit>/files."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    storage = cache / "hf" / f"models--{repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in files.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    return commit


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at its import


def test_hf_offline_from_a_prepared_cache(offline: None, tiny_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    commit = hf_cache(cache, "acme/tiny-llama", tiny_dir)
    loaded = load_model("hf://acme/tiny-llama", model_cache=cache)
    assert same_weights(loaded.model, load_model(tiny_dir).model)
    assert Path(fetch_model("hf://acme/tiny-llama", cache)).name == commit
    hf_cache(cache, "acme/tiny-llama", tiny_dir, revision="v1")
    assert Path(fetch_model("hf://acme/tiny-llama@v1", cache)).name == commit
    assert Path(fetch_model(f"hf://acme/tiny-llama@{commit}", cache)).name == commit
    assert served_name("hf://acme/tiny-llama@v1") == "acme/tiny-llama"
    assert ServerSettings(model="hf://acme/tiny-llama@v1").model_name == "acme/tiny-llama"


def test_the_engine_takes_its_model_cache_from_its_settings(
    offline: None, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.engine.engine import LLMEngine

    monkeypatch.delenv("LORAPLEX_MODEL_CACHE", raising=False)
    cache = tmp_path / "settings-cache"
    hf_cache(cache, "acme/tiny-llama", tiny_dir)
    # No compiled decode: a cold Inductor compile (~20 CPU-s) says nothing about where the model came from.
    settings = ServerSettings(
        model="hf://acme/tiny-llama", model_cache=cache, num_pages=8, device="cpu", compile_decode=False
    )
    engine = LLMEngine(settings.engine_config())
    # dtype "auto": bfloat16 on a CPU that computes it natively, so the reference loads the same dtype.
    assert same_weights(engine.loaded.model, load_model(tiny_dir, engine.loaded.model.dtype).model)


def test_hf_not_cached_offline_is_one_clear_line(offline: None, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as caught:
        fetch_model("hf://acme/absent", tmp_path)
    message = str(caught.value)
    assert message.startswith("hf://acme/absent: not in the model cache") and "\n" not in message


@pytest.mark.parametrize(
    "uri",
    [
        "hf://",
        "hf://acme/",
        "hf://a/b/c",
        "hf://acme/x@",
        "hf://acme/x@../main",
        "hf://acme/x y",
        "hf://-a/b",
    ],
)
def test_hf_malformed(uri: str) -> None:
    with pytest.raises(ModelSourceError):
        parse_hf(uri)


def test_hf_ids() -> None:
    assert parse_hf("hf://HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert parse_hf("hf://gpt2@refs/pr/1") == ("gpt2", "refs/pr/1")


# --- loraplex serve: the one line, also in the termination log ------------------------------------------


def test_serve_with_a_malformed_uri_exits_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("LORAPLEX_TERMINATION_LOG", str(log))
    assert loraplex_main(["serve", "--model", "hf://acme/x@../etc"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("loraplex serve: model: hf://acme/x@../etc: ") and "\n" not in line
    assert log.read_text() == line + "\n"


def test_serve_with_a_uri_that_does_not_resolve_exits_with_one_line(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("LORAPLEX_TERMINATION_LOG", str(log))
    monkeypatch.setenv("LORAPLEX_MODEL_CACHE", str(tmp_path / "cache"))
    code = loraplex_main(["serve", "--model", "s3://models/missing/", "--port", "0", "--device", "cpu"])
    assert code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        "loraplex serve: the model failed to load: nothing at s3://models/missing/: "
        "no such object and no objects under missing/"
    )
    assert log.read_text() == line + "\n"


def test_termination_log_is_never_created_under_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.engine.server import serve

    monkeypatch.delenv("LORAPLEX_TERMINATION_LOG", raising=False)
    monkeypatch.setattr(serve, "TERMINATION_LOG", "/nonexistent-dir/termination-log")
    serve.report_fatal("loraplex serve: x")  # no file, no error
    assert not os.path.exists("/nonexistent-dir/termination-log")
