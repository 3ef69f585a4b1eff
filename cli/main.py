"""The `loraplex` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

# The options' declarations (no torch, no FastAPI): every engine and server flag is built from them.
from loraplex.engine.config import ENGINE_OPTIONS, EngineConfig
from loraplex.engine.options import add_arguments, values_given
from loraplex.engine.server.settings import ALL_OPTIONS, ServerSettings

from .serve_args import add_serve_arguments


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine import LLMEngine, SamplingParams
    from loraplex.engine.model.errors import ModelLoadError

    try:
        config = EngineConfig(**values_given(args, ENGINE_OPTIONS))
        engine = LLMEngine(config)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=config.seed,
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

    flags = values_given(args, ALL_OPTIONS)
    if args.adapter is not None:
        flags["adapters"] = args.adapter
    try:
        # Flags given on the command line win; the rest come from LORAPLEX_* variables, then defaults.
        settings = ServerSettings(**flags)
    except ValidationError as exc:  # one line per problem, naming the option: "adapters: ..."
        problems = [_problem(e) for e in exc.errors()]
        report_fatal(f"loraplex serve: {'; '.join(problems)}")
        return 2
    except ValueError as exc:  # a LORAPLEX_* variable with a value its option refuses
        report_fatal(f"loraplex serve: {exc}")
        return 2
    return run_server(settings)


def _tokenizer_export(args: argparse.Namespace) -> int:
    from loraplex.engine.model.errors import ModelLoadError
    from loraplex.engine.tokenizer_export import export_tokenizer, load_tokenizer

    try:
        tokenizer, context = load_tokenizer(args.model)
        directory = export_tokenizer(tokenizer, args.directory, context)
    except (ModelLoadError, OSError) as exc:
        print(f"loraplex tokenizer export: {exc}", file=sys.stderr)
        return 2
    print(directory)
    return 0


def _problem(error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    field = ".".join(str(p) for p in error["loc"])
    # An option's refusal names it already ("max_num_seqs must be ..."); other errors get the field's name.
    return message if not field or message.startswith(f"{field} ") else f"{field}: {message}"


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


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a command line `loraplex serve` refuses is reported as its other fatal errors
    are: one line on stderr and in the termination log (what Kubernetes shows for a pod whose extraArgs
    are wrong), exit 2. Other commands keep argparse's usage and message."""

    one_line_errors = False

    def error(self, message: str) -> NoReturn:
        if not self.one_line_errors:
            super().error(message)
        from loraplex.engine.server.serve import report_fatal

        # "argument --max-num-seqs: max_num_seqs must be ..." says the option twice: once is enough.
        flag, _, rest = message.partition(": ")
        said = rest if flag.startswith("argument --") and _names_an_option(rest) else message
        report_fatal(f"{self.prog}: {said}")
        raise RefusedCommandLine(2)


class RefusedCommandLine(SystemExit):
    """A command line refused after saying why: main() returns its status rather than exiting."""


def _names_an_option(message: str) -> bool:
    return any(message.startswith((f"{name} ", f"{name}:")) for o in ALL_OPTIONS for name in o.names)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="loraplex", description="Serve many LoRA fine-tunes of one model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = commands.add_parser(
        "generate",
        help="complete one prompt and print only the completion",
        description="The engine's options are those of `loraplex serve` (docs/configuration.md); --seed "
        "also seeds the sampling.",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--adapter", default=None, help="a PEFT LoRA directory to answer with")
    add_arguments(gen.add_argument_group("engine options"), ENGINE_OPTIONS)
    gen.set_defaults(handler=_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the model and its adapters over an OpenAI-compatible HTTP API",
        description="Every option also reads from LORAPLEX_<OPTION> (e.g. LORAPLEX_NUM_PAGES); flags win. "
        "The internal token is a variable only: LORAPLEX_INTERNAL_TOKEN.",
        # No prefixes: `--por 9000` must not be `--port 9000` (the operator refuses options it sets, and
        # checks extraArgs with this same parser: cli/serve_args.py).
        allow_abbrev=False,
    )
    add_serve_arguments(serve)
    serve.one_line_errors = True
    serve.set_defaults(handler=_serve, command_parser=serve)

    tokenizer = commands.add_parser("tokenizer", help="the model's tokenizer, for tools outside loraplex")
    tokenizer_commands = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=Parser
    )
    export = tokenizer_commands.add_parser(
        "export",
        help="write the model's tokenizer as a Hugging Face tokenizer directory",
        description="Writes tokenizer.json, tokenizer_config.json (special tokens, chat template, context "
        "length) and special_tokens_map.json: transformers' AutoTokenizer.from_pretrained(DIR) loads it "
        "and tokenizes exactly as the engine does (benchmark clients such as guidellm and inference-perf "
        "need it).",
    )
    export.add_argument("directory", type=Path, help="where to write it (made if missing)")
    export.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face model directory, as `loraplex serve --model` takes "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    export.set_defaults(handler=_tokenizer_export)

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
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # what parse_args does, but told by the command's own parser (serve: one line)
            getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except RefusedCommandLine as refused:
        return int(refused.code or 2)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
