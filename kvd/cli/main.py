"""``kvd`` commands. ``main(argv)`` returns an exit code.

Exit codes: 0 ok; 1 a daemon that cannot be reached, or ``doctor`` found a
problem; 2 invalid settings or usage (an option out of range, a missing file, a
socket path ``serve`` cannot use, no cluster secret). Every error is one line
on stderr (invalid settings: one line per problem), never a traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvd import __version__
from kvd.errors import ConfigError, KvdError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvd: KV-cache transfer sidecar for PD-disaggregated LLM serving")
config_app = typer.Typer(no_args_is_help=True, help="Inspect settings.")
app.add_typer(config_app, name="config")

# ---- shared options -------------------------------------------------------------------------

def _positive(value: float | None) -> float | None:
    """Option callback: a duration must be > 0 (0 would time out before asking)."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value:g} is not a positive number of seconds")
    return value


# Every option a user types is validated here (click: ranges, existing readable files);
# settings are validated by kvd.config with their source. Both give one line and exit 2.
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", envvar="KVD_CONFIG", exists=True, dir_okay=False, readable=True,
    help="TOML settings file (see config/kvd.toml)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
AddrOpt = Annotated[str | None, typer.Option(
    "--addr", "-a", envvar="KVD_ADDR",
    help="the daemon's REST address HOST:PORT (default: from --config, else 127.0.0.1:8998)")]
TimeoutOpt = Annotated[float, typer.Option(callback=_positive, max=3600,
                                           help="seconds to wait for the daemon (> 0)")]
RoleOpt = Annotated[str | None, typer.Option(help="prefill or decode")]
HttpPortOpt = Annotated[int | None, typer.Option(min=0, max=65535, help="REST port (0: any)")]
SocketOpt = Annotated[Path | None, typer.Option(dir_okay=False,
                                                help="engine RPC socket path")]
LevelOpt = Annotated[str | None, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ...")]
FormatOpt = Annotated[str | None, typer.Option("--log-format", help="text or json")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="any setting: --set KEY=VALUE (repeatable)")]


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"kvd: {message}", err=True)
    return typer.Exit(code)


def _overrides(sets: list[str] | None, **named: Any) -> dict[str, Any]:
    from kvd.config import parse_assignments

    out: dict[str, Any] = parse_assignments(sets or [])
    out.update({k: v for k, v in named.items() if v is not None})
    return out


# ---- daemon ---------------------------------------------------------------------------------

@app.command()
def serve(config: ConfigOpt = None, role: RoleOpt = None, http_port: HttpPortOpt = None,
          engine_socket: SocketOpt = None, log_level: LevelOpt = None,
          log_format: FormatOpt = None, set_: SetOpt = None) -> None:
    """Run the daemon until SIGTERM/SIGINT (sends READY/STOPPING/WATCHDOG to systemd)."""
    from kvd.cli.doctor import refusals
    from kvd.config import load_settings
    from kvd.daemon import serve as run

    try:
        settings = load_settings(config, **_overrides(
            set_, role=role, http_port=http_port, engine_socket=engine_socket,
            log_level=log_level, log_format=log_format))
        problems = refusals(settings)  # checked before anything starts: one line each
        for problem in problems:
            typer.echo(f"kvd: {problem}", err=True)
        if problems:
            raise typer.Exit(2)
        code = run(settings)
    except KvdError as exc:
        from kvd import logs

        if not logs.configured():
            raise _fail(str(exc), 2) from None
        # the daemon's logging is up: the reason is a record in its format (JSON stays JSON)
        logging.getLogger("kvd").error("%s", exc)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def status(addr: AddrOpt = None, config: ConfigOpt = None, json_: JsonOpt = False,
           timeout: TimeoutOpt = 3.0) -> None:
    """Role, uptime, readiness, peers, rooms by state, throughput, recent failures."""
    from kvd.cli import client, render

    data = client.get(client.resolve_addr(addr, config), "/v1/status", timeout, config)
    render.print_json(data) if json_ else render.status(data)


@app.command()
def rooms(addr: AddrOpt = None, config: ConfigOpt = None, json_: JsonOpt = False,
          timeout: TimeoutOpt = 3.0,
          all_: Annotated[bool, typer.Option("--all", help="include finished rooms")] = False,
          limit: Annotated[int, typer.Option(min=1, max=100_000,
                                             help="at most this many rooms")] = 1000) -> None:
    """Rooms in flight (oldest first): state, age, peer."""
    from kvd.cli import client, render

    data = client.get(client.resolve_addr(addr, config), "/v1/rooms", timeout, config,
                      all=str(all_).lower(), limit=limit)
    render.print_json(data) if json_ else render.rooms(data)


@app.command()
def peers(addr: AddrOpt = None, config: ConfigOpt = None, json_: JsonOpt = False,
          timeout: TimeoutOpt = 3.0) -> None:
    """Peer ranks and their heartbeat state."""
    from kvd.cli import client, render

    data = client.get(client.resolve_addr(addr, config), "/v1/status", timeout, config,
                      failures=0)
    render.print_json(data["peers"]) if json_ else render.peers(data["peers"])


# ---- local ----------------------------------------------------------------------------------

@config_app.command("show")
def config_show(config: ConfigOpt = None, role: RoleOpt = None, set_: SetOpt = None,
                json_: JsonOpt = False) -> None:
    """Every effective setting and where it came from (default, file, env, cli)."""
    from kvd.cli import render
    from kvd.config import load_with_sources

    settings, sources = load_with_sources(config, **_overrides(set_, role=role))
    values = settings.model_dump(mode="json")
    rows = {k: {"value": values[k], "source": sources[k].kind, "origin": sources[k].origin}
            for k in values}
    render.print_json(rows) if json_ else render.config(rows)


@config_app.command("template")
def config_template() -> None:
    """Print every setting with its default and unit, as TOML (config/kvd.toml)."""
    from kvd.config import toml_template

    sys.stdout.write(toml_template())


@app.command()
def doctor(config: ConfigOpt = None, role: RoleOpt = None, set_: SetOpt = None,
           json_: JsonOpt = False) -> None:
    """Check this machine for kvd: transfer engine, RDMA, memlock, /dev/shm, ports, socket."""
    from kvd.cli import render
    from kvd.cli.doctor import as_dicts, run_checks
    from kvd.config import load_settings

    settings, error = None, None
    try:
        settings = load_settings(config, **_overrides(set_, role=role or "decode"))
    except ConfigError as exc:
        error = exc
    checks = as_dicts(run_checks(settings, error, config=config))
    render.print_json(checks) if json_ else render.doctor(checks)
    raise typer.Exit(1 if any(c["status"] == "fail" for c in checks) else 0)


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(min=1, help="number of prompts")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate per prompt")
                              ] = 16,
    page_size: Annotated[int, typer.Option(min=1, help="tokens per KV page")] = 16,
    chunk_pages: Annotated[int, typer.Option(min=1, help="pages per prefill chunk")] = 4,
    hybrid: Annotated[bool, typer.Option(help="also the hybrid model's rows (state slots and "
                                              "window pages, prefill TP 1 -> decode TP 2)")
                      ] = True,
    retile: Annotated[bool, typer.Option(help="also rows with prefill page size 16 and "
                                              "decode page size 64 (pages re-tiled by kvd)")
                      ] = True,
    spec: Annotated[bool, typer.Option(help="also the speculative-decoding rows (draft model "
                                            "KV and typed aux, prefill TP 1 -> decode TP 2)")
                    ] = True,
) -> None:
    """Prefill on one engine, move KV through two kvd daemons, decode on another."""
    from kvd.refengine.demo import demo_console, run_demo

    code = run_demo(prompts, max_new_tokens, page_size, chunk_pages)
    if retile:  # two long prompts, chunks of 3 pages (48 tokens: not whole decode pages)
        code |= run_demo(2, max_new_tokens, 16, 3, demo_console(), backends=("mooncake",),
                         decode_page_size=64, first_prompt=4)
    if hybrid:
        from kvd.refengine.hybriddemo import run_hybrid_rows

        code |= run_hybrid_rows(demo_console(), max_new_tokens=max_new_tokens)
    if spec:
        from kvd.refengine.specdemo import run_spec_rows

        code |= run_spec_rows(demo_console(), max_new_tokens=max_new_tokens)
    raise typer.Exit(code)


@app.command()
def secret(
    path: Annotated[Path, typer.Argument(dir_okay=False, help="file to create (mode 0600)")],
    force: Annotated[bool, typer.Option("--force", help="replace an existing file")] = False,
) -> None:
    """Write a new random cluster secret to PATH (mode 0600); point cluster_secret_file at it.

    The same file (or its content, as KVD_CLUSTER_SECRET) goes to every kvd of the
    cluster. Without kvd: python3 -c 'import secrets; print(secrets.token_hex(32))'.
    """
    from kvd.config import write_secret_file

    try:
        write_secret_file(path, force)
    except FileExistsError:
        raise _fail(f"{path} exists: keep it, or pass --force to replace it (every kvd "
                    f"of the cluster then needs the new secret)", 2) from None
    except OSError as exc:
        raise _fail(f"cannot write {path}: {exc.strerror or exc}", 2) from None
    # the absolute path: a daemon started elsewhere (systemd: cwd /) reads a relative one
    # from its own working directory
    typer.echo(f"wrote a new cluster secret to {path} (mode 0600); set "
               f"cluster_secret_file = \"{path.resolve()}\" in every kvd's settings", err=True)


@app.command()
def proxy(
    prefill: Annotated[list[str], typer.Option(
        "--prefill", "-p", help="base URL of a prefill engine (repeatable)")],
    decode: Annotated[list[str], typer.Option(
        "--decode", "-d", help="base URL of a decode engine (repeatable)")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8000,
    retries: Annotated[int, typer.Option(min=0, help="extra attempts per request")] = 2,
    timeout: Annotated[float, typer.Option(min=0.001, help="seconds per engine request")] = 600.0,
    health_interval: Annotated[float, typer.Option(
        min=0, help="seconds between health probes of each engine (0: none)")] = 5.0,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", envvar="KVD_PROXY_TOKEN_FILE",
        help="file whose first line is the bearer token every request but GET /health and "
             "/metrics must carry (Authorization: Bearer ...); owned by this user, mode "
             "0600 (proxy_token_file; default: no authentication)")] = None,
    max_body: Annotated[int, typer.Option(
        min=0, help="largest request body, bytes (larger: 413, unread)")] = 4 << 20,
    body_timeout: Annotated[float, typer.Option(
        min=0.001, help="seconds to receive a whole request body (then 408)")] = 10.0,
    header_timeout: Annotated[float, typer.Option(
        min=0.001, help="seconds to receive a request head, from connecting or from the "
                        "last response (then the connection is closed)")] = 5.0,
    max_connections: Annotated[int, typer.Option(
        min=1, help="open client connections at most (idle ones are closed to make room; "
                    "when all are busy a newcomer is refused)")] = 1024,
    expose_servers: Annotated[bool, typer.Option(
        "--expose-servers", help="name engine URLs in /health, /metrics and 502 answers "
                                 "(default: by role and index)")] = False,
    log_level: Annotated[str, typer.Option("--log-level")] = "WARNING",
) -> None:
    """PD router: each OpenAI request is prefilled on one engine and decoded on another,
    the KV moving through kvd (least outstanding requests first; retries; streaming;
    a client that leaves cancels both legs; /health and /metrics). A public HTTP
    service: body caps, head and body deadlines, a connection cap, optional bearer
    token."""
    import asyncio

    from kvd import logs
    from kvd.proxy.app import ProxyConfig
    from kvd.proxy.serve import app_for, serve

    urls = [u for u in (*prefill, *decode) if not u.startswith(("http://", "https://"))]
    if urls:
        raise _fail(f"engine URLs must start with http:// or https://: {', '.join(urls)}", 2)
    config = ProxyConfig(tuple(prefill), tuple(decode), retries, timeout, health_interval,
                         max_body=max_body, body_timeout=body_timeout,
                         header_timeout=header_timeout, max_connections=max_connections,
                         token_file=token_file, expose_servers=expose_servers)
    try:
        proxy_app = app_for(config, host)  # refuses a bad token file before logging starts
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    logs.setup(log_level.upper())

    def ready(bound: int) -> None:
        typer.echo(f"kvd proxy: listening on http://{host}:{bound}", err=True)

    try:
        asyncio.run(serve(config, host, port, ready, app=proxy_app))
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None


@app.command()
def version(json_: JsonOpt = False) -> None:
    """Print kvd's version."""
    if json_:
        from kvd.cli.render import print_json

        print_json({"version": __version__, "python": sys.version.split()[0]})
    else:
        typer.echo(__version__)


def _usage_line(exc: Exception) -> str:
    """A click usage error as one line: ``kvd status: Invalid value for '--timeout': ...``."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "kvd"
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    return f"{where}: {message} (see {where} --help)"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code instead of exiting."""
    try:
        # standalone_mode=False: click returns typer.Exit's code instead of raising it
        rc = app(args=argv if argv is not None else sys.argv[1:], prog_name="kvd",
                 standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        typer.echo("kvd: aborted", err=True)
        return 130
    except ConfigError as exc:
        typer.echo(f"kvd: {exc}", err=True)
        return 2
    except KvdError as exc:  # DaemonUnreachable and friends: one line
        typer.echo(f"kvd: {exc}", err=True)
        return 1
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:
        # click's usage errors (typer may vendor its own click: match by shape, not class)
        if callable(getattr(exc, "format_message", None)) and \
                isinstance(getattr(exc, "exit_code", None), int):
            typer.echo(_usage_line(exc), err=True)
            return int(exc.exit_code)  # type: ignore[attr-defined]
        raise
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
