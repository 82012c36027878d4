"""``kvd demo``: a real model prefilled on one engine, decoded on another, KV moved by kvd.

Starts, as separate processes on loopback: a prefill kvd that also serves bootstrap,
a decode kvd, and the two reference engines (:mod:`kvd.refengine.engines`). Each
prompt goes through the disaggregated path and its completion is compared token for
token with a non-disaggregated run of the same model. The prompts are split between
the transfer backends (``mooncake`` over loopback TCP, then ``local`` same-host
copies): between the groups the daemons restart with the next backend on the same
sockets and ports, and the engines reconnect and register again on their own. Prints
a table (a column says which backend moved each row) and returns 1 if any prompt
differs (or fails), else 0. Every child is stopped on the way out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvd.launch import DaemonProcess, start_daemon

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering. Keep it "
    "simple enough for a ten-year-old who likes astronomy and asks many questions.",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order from the sun, and give one fact about each "
    "of them: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. Then say which "
    "one you would visit first and why, considering temperature, gravity, distance and the "
    "view of the rings.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish, French and German.",
    "Summarise the plot of Romeo and Juliet. Mention the families, the balcony, the secret "
    "marriage, Tybalt, the banishment, the potion, and the ending in the tomb, in a short "
    "paragraph of plain English suitable for a student preparing for an exam tomorrow.",
    "Give me a tip for learning to play the guitar.",
    "Why do cats purr?",
]


class EngineProcess:
    """A reference engine child speaking JSON lines on stdin/stdout."""

    def __init__(self, role: str, sockets: list[str], log: Path, env: dict[str, str],
                 page_size: int, tp: int = 1, pp: int = 1) -> None:
        self.log = log.open("wb")
        args = [a for s in sockets for a in ("--socket", s)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.refengine.engines", role, *args,
             "--page-size", str(page_size), "--tp", str(tp), "--pp", str(pp)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def request(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited (code {self.proc.wait()}); see {self.log.name}")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # same threads everywhere: identical numerics
    env.setdefault("KVD_REFMODEL_CACHE_DIR", str(Path.cwd() / ".cache" / "refmodel"))
    env.setdefault("TQDM_DISABLE", "1")
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_daemons(work: Path, prefill_tp: int, prefill_pp: int, decode_tp: int,
                   backend: str, boot_port: int
                   ) -> tuple[list[DaemonProcess], list[DaemonProcess]]:
    """Prefill ranks (tp-major, then pp; rank (0, 0) serves bootstrap on ``boot_port``),
    decode ranks; engine sockets named by rank so a restart reuses them."""
    prefill: list[DaemonProcess] = []
    common: dict[str, Any] = {"transfer_backend": backend}
    for tp in range(prefill_tp):
        for pp in range(prefill_pp):
            where: dict[str, Any] = (
                {"serve_bootstrap": True, "http_port": boot_port} if not prefill
                else {"bootstrap_addr": prefill[0].http_addr})
            prefill.append(start_daemon(
                "prefill", work, attn_tp_size=prefill_tp, attn_tp_rank=tp, pp_size=prefill_pp,
                pp_rank=pp, engine_socket=str(work / f"prefill-{tp}-{pp}.sock"), **common,
                **where))
    decode = [start_daemon("decode", work, attn_tp_size=decode_tp, attn_tp_rank=tp,
                           engine_socket=str(work / f"decode-{tp}.sock"), **common)
              for tp in range(decode_tp)]
    return prefill, decode


def run_demo(n_prompts: int = 8, max_new_tokens: int = 16, page_size: int = 16,
             chunk_pages: int = 4, console: Console | None = None, prefill_tp: int = 1,
             decode_tp: int = 1, prefill_pp: int = 1,
             backends: tuple[str, ...] = ("mooncake", "local"),
             decode_page_size: int | None = None, first_prompt: int = 0) -> int:
    """Run the demo; returns 0 if every completion equals the reference, else 1.

    ``prefill_tp``/``prefill_pp``/``decode_tp`` shard the engines' KV pools (one kvd per
    rank); the model has 3 KV heads and 30 layers. The prompts (``first_prompt`` on) are
    split between ``backends`` in order (consecutive groups). ``page_size`` is the
    prefill engine's tokens per page, ``decode_page_size`` the decode's (None: the same;
    another one is re-tiled by kvd, issue 22 item 3).
    """
    d_page = decode_page_size or page_size
    console = console or demo_console()
    work = Path(tempfile.mkdtemp(prefix="kvd-demo-"))
    daemons: list[DaemonProcess] = []
    engines: list[EngineProcess] = []
    codes: list[int] = []
    rows: list[dict[str, Any]] = []
    boot_port = _free_port()
    try:
        prefill, decode = _start_daemons(work, prefill_tp, prefill_pp, decode_tp, backends[0],
                                         boot_port)
        daemons = prefill + decode
        env = _engine_env()
        engines.append(EngineProcess("prefill", [d.socket for d in prefill],
                                     work / "prefill-engine.log", env, page_size, prefill_tp,
                                     prefill_pp))
        engines.append(EngineProcess("decode", [d.socket for d in decode],
                                     work / "decode-engine.log", env, d_page, decode_tp))
        t0 = time.perf_counter()
        loads = [e.reply() for e in engines]
        load = ", ".join(f"{r.get('load_s', 0.0):.1f}s" for r in loads)
        console.print(f"engines ready in {time.perf_counter() - t0:.1f}s (model load {load})")
        for k, backend in enumerate(backends):
            if k:  # the same sockets and ports, the next backend; the engines reconnect
                codes += [d.stop() for d in daemons]
                prefill, decode = _start_daemons(work, prefill_tp, prefill_pp, decode_tp,
                                                 backend, boot_port)
                daemons = prefill + decode
            first = first_prompt + k * n_prompts // len(backends)
            last = first_prompt + (k + 1) * n_prompts // len(backends)
            rows += [r | {"backend": backend} for r in _run_prompts(
                engines[0], engines[1], prefill[0].http_addr, range(first, last),
                max_new_tokens, chunk_pages)]
    finally:
        for e in engines:
            e.stop()
        codes += [d.stop() for d in daemons]
    pages = str(page_size) if d_page == page_size else f"{page_size} -> {d_page}"
    _print_table(console, rows, pages, chunk_pages,
                 f"prefill TP{prefill_tp} PP{prefill_pp} -> decode TP{decode_tp}")
    ok = all(r["equal"] for r in rows) and len(rows) == n_prompts
    ok_exit = all(c == 0 for c in codes)
    if ok and ok_exit:
        shutil.rmtree(work, ignore_errors=True)
        console.print(f"daemons exited with {codes}")
    else:
        console.print(f"daemons exited with {codes}; logs kept in {work}")
    console.print("[green]all completions equal[/green]" if ok
                  else "[red]some completions differ or failed[/red]")
    return 0 if ok and ok_exit else 1


def _run_prompts(prefill: EngineProcess, decode: EngineProcess, bootstrap: str,
                 indices: range, max_new_tokens: int, chunk_pages: int
                 ) -> list[dict[str, Any]]:
    rows = []
    for i in indices:
        prompt = PROMPTS[i % len(PROMPTS)] + (f" (variant {i // len(PROMPTS)})"
                                               if i >= len(PROMPTS) else "")
        tokens = _encode_via(prefill, prompt)
        room = 1000 + i
        decode.request({"op": "receive", "room": room, "bootstrap": bootstrap,
                        "num_tokens": len(tokens), "max_new_tokens": max_new_tokens})
        prefill.request({"op": "prefill", "room": room, "tokens": tokens,
                         "chunk_pages": chunk_pages})
        p, d = prefill.reply(), decode.reply()
        prefill.request({"op": "reference", "tokens": tokens, "max_new_tokens": max_new_tokens})
        ref = prefill.reply()
        rows.append(_row(prompt, tokens, p, d, ref) | {"setup": i == indices[0]})
    return rows


def _encode_via(engine: EngineProcess, prompt: str) -> list[int]:
    engine.request({"op": "encode", "prompt": prompt})
    result = engine.reply()
    if "tokens" not in result:
        raise RuntimeError(f"engine could not encode: {result}")
    tokens: list[int] = result["tokens"]
    return tokens


def _row(prompt: str, tokens: list[int], p: dict[str, Any], d: dict[str, Any],
         ref: dict[str, Any]) -> dict[str, Any]:
    got, want = d.get("tokens"), ref.get("tokens")
    problem = p.get("error") or p.get("reason") or d.get("error") or d.get("reason") or ""
    return {"prompt": prompt, "tokens": len(tokens), "pages": p.get("pages", 0),
            "kv_bytes": p.get("xfer_bytes", 0), "xfer_s": p.get("xfer_s", 0.0),
            "chunks": p.get("chunks", 0), "aux_ok": d.get("aux_room_ok", False),
            "equal": got is not None and got == want and d.get("aux_room_ok", False),
            "completion": got, "problem": problem}


def demo_console() -> Console:
    """Where the demo prints: a terminal's width, else 160 columns (as the CLI's views):
    rich's 80-column default for a pipe or a CI log cut the table's numbers
    ("2,211,8…", "transf…")."""
    return Console(width=None if sys.stdout.isatty() else 160)


def _print_table(console: Console, rows: list[dict[str, Any]], page_size: str,
                 chunk_pages: int, topology: str) -> None:
    table = Table(title=f"kvd demo: page_size={page_size}, prefill chunk={chunk_pages} pages, "
                        f"{topology}")
    for col in ("#", "backend", "prompt tokens", "pages", "chunks", "KV bytes", "transfer ms",
                "GB/s", "equal?"):
        table.add_column(col, justify="right")
    table.caption = ("* the first room after the daemons start: its time includes finding the "
                     "peer (bootstrap lookup) and opening the transfer session, once")
    for i, r in enumerate(rows):
        gbps = r["kv_bytes"] / r["xfer_s"] / 1e9 if r["xfer_s"] else 0.0
        mark = "*" if r.get("setup") else ""
        table.add_row(str(i), r.get("backend", "-"), str(r["tokens"]), str(r["pages"]),
                      str(r["chunks"]),
                      f"{r['kv_bytes']:,}", f"{r['xfer_s'] * 1e3:.2f}{mark}",
                      f"{gbps:.2f}{mark}",
                      "[green]yes[/green]" if r["equal"] else f"[red]NO[/red] {r['problem']}")
    console.print(table)


def main() -> int:
    """``python -m kvd.refengine.demo``."""
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
