"""The `loraplex` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
    from loraplex.engine.model.errors import ModelLoadError

    try:
        engine = LLMEngine(
            EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed)
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop or ()),
        )
        adapter = None
        if args.adapter:
            adapter = "cli-adapter"
            engine.register_adapter(adapter, args.adapter)
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot take a text prompt")
        ids = (
            engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
            if args.chat
            else engine.tokenizer.encode(args.prompt)
        )
        output = engine.generate([ids], params, adapters=adapter)[0]
    except (ModelLoadError, ValueError) as exc:
        print(f"loraplex generate: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(output.text)
    if not output.text.endswith("\n"):
        sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    # FastAPI, uvicorn and torch load only here: `loraplex --help` stays quick.
    from pydantic import ValidationError

    from loraplex.engine.server.serve import report_fatal, run_server
    from loraplex.engine.server.settings import ServerSettings

    flags = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "dtype": args.dtype,
        "served_model_name": args.served_model_name,
        "num_pages": args.num_pages,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_queue": args.max_queue,
        "adapters": args.adapter,
    }
    try:
        # Flags given on the command line win; the rest come from LORAPLEX_* variables, then defaults.
        settings = ServerSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:  # one line per problem, naming the option: "model: ..."
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: "
            + str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        ]
        report_fatal(f"loraplex serve: {'; '.join(problems)}")
        return 2
    except ValueError as exc:
        report_fatal(f"loraplex serve: {exc}")
        return 2
    return run_server(settings)


def _operator(args: argparse.Namespace) -> int:
    # kopf and the handlers load only here: the engine's install needs neither.
    import kopf

    import loraplex.operator.main  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
        standalone=args.standalone,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA fine-tunes of one model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete one prompt and print only the completion")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0, help="seed for sampling and random weights")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument(
        "--model", default=None, help="a .gguf file, a Hugging Face directory, or random:<shape>"
    )
    gen.add_argument("--adapter", default=None, help="a PEFT LoRA directory to answer with")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    gen.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    gen.set_defaults(handler=_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the model and its adapters over an OpenAI-compatible HTTP API",
        description="Every option also reads from LORAPLEX_<OPTION> (e.g. LORAPLEX_NUM_PAGES); flags win.",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="a .gguf file or Hugging Face directory (path or file://), s3://bucket/key-or-prefix/, "
        "or hf://org/name[@revision]; remote models are cached in LORAPLEX_MODEL_CACHE",
    )
    serve.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    serve.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="NAME=PATH_OR_URI",
        help="register an adapter at start, optionally NAME=URI@SHA256 (repeatable)",
    )
    serve.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    serve.add_argument("--served-model-name", default=None, help="the base model's id in the API")
    serve.add_argument(
        "--num-pages", type=int, default=None, help="pool size in pages (default: from memory)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=None, help="requests in the running batch at most")
    serve.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens at most")
    serve.add_argument(
        "--max-queue", type=int, default=None, help="waiting requests before 429 (default 256)"
    )
    serve.set_defaults(handler=_serve)

    from loraplex.web import cli as web_cli

    web = commands.add_parser("control-plane", help="run the control plane (API, gateway) on one port")
    web_cli.add_arguments(web)
    web.set_defaults(handler=web_cli.run)

    from . import up

    up_parser = commands.add_parser(
        "up",
        help="the whole platform on one machine: engine, console, API and gateway on one port",
        description="Starts the engine (SmolLM2-135M-Instruct) and the control plane, sets up a demo "
        "tenant, user, key and adapter, and prints how to use them. Ctrl-C stops everything.",
    )
    up.add_arguments(up_parser)
    up_parser.set_defaults(handler=up.run)

    op = commands.add_parser(
        "operator", help="run the Kubernetes operator (same as kopf run -m loraplex.operator.main)"
    )
    scope = op.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", help="namespace to watch (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint")
    op.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    op.set_defaults(handler=_operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
