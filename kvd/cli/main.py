"""``kvd`` commands. ``main(argv)`` returns an exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvd import __version__
from kvd.errors import KvdError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvd: KV-cache transfer sidecar for PD-disaggregated LLM serving")


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    role: Annotated[str | None, typer.Option(help="prefill or decode")] = None,
    http_port: Annotated[int | None, typer.Option(help="HTTP port (0: any)")] = None,
    engine_socket: Annotated[Path | None, typer.Option(help="engine RPC socket path")] = None,
    log_level: Annotated[str | None, typer.Option("--log-level")] = None,
) -> None:
    """Run the daemon until SIGTERM/SIGINT."""
    from kvd.config import load_settings
    from kvd.daemon import serve as run

    try:
        settings = load_settings(config, role=role, http_port=http_port,
                                 engine_socket=engine_socket, log_level=log_level)
        code = run(settings)
    except KvdError as exc:
        typer.echo(f"kvd: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="number of prompts (>= 1)")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 16,
    page_size: Annotated[int, typer.Option(help="tokens per KV page")] = 16,
    chunk_pages: Annotated[int, typer.Option(help="pages per prefill chunk")] = 4,
) -> None:
    """Prefill on one engine, move KV through two kvd daemons, decode on another."""
    from kvd.refengine.demo import run_demo

    raise typer.Exit(run_demo(prompts, max_new_tokens, page_size, chunk_pages))


@app.command()
def version() -> None:
    """Print kvd's version."""
    typer.echo(__version__)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code instead of exiting."""
    try:
        app(args=argv if argv is not None else sys.argv[1:], standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except SystemExit as exc:  # click usage errors
        return int(exc.code or 0)
    except Exception as exc:  # click.ClickException and friends
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
