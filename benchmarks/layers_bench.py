"""Layer streaming vs whole-room transfer: TTFT of a long prompt on the reference engine
(issue 22 items 4 and 7).

Two real daemons (prefill, decode) over Mooncake TCP on loopback; the reference model
(SmolLM2-135M on the CPU, :mod:`kvd.refengine.model`) runs the prompt in this process
through :class:`kvd.refengine.engines.PrefillEngine`, alternately

* ``whole``: the forward pass, then the room's pages in one send (every layer);
* ``layers``: ``Sender.send_layers`` after each layer's forward, the last layer with aux.

TTFT is measured from prefill start to the decode's ``Receiver`` reporting Success (the
decode has the room). ``exposed`` = TTFT - forward time: the transfer time left after
compute. The row reports medians over ``repeats`` runs of each mode, interleaved (same run,
same load), the TTFT ratio layers/whole and the fraction of the whole-room transfer time
hidden under compute: ``1 - exposed(layers) / exposed(whole)`` (goal >= 0.5), both taken
per repeat (the two modes back to back) and then their median.

``--layers`` keeps only the model's first N decoder layers (its size as a parameter: compute
and KV shrink alike, so the ratios hold); ``--tokens`` is the prompt length;
``--page-size``/``--decode-page-size`` the prefill's and the decode's tokens per page (a
decode of another page size is written in tokens, re-tiled, layer ranges included).

Usage: python benchmarks/layers_bench.py [--tokens 8192] [--layers 30] [--repeats 3]
       [--page-size 16] [--decode-page-size 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd.client import KvdClient, KVPoll, Receiver
from kvd.launch import start_daemon
from kvd.refengine.engines import PagedKVPool, PrefillEngine
from kvd.refengine.model import RefModel

PAGE_SIZE = 16
GOAL_HIDDEN = 0.5


def run(tokens: int = 8192, layers: int = 0, repeats: int = 3, page_size: int = PAGE_SIZE,
        decode_page_size: int = 0) -> dict[str, Any]:
    """Measure both modes; returns the row (seconds, ratios) with every run's numbers.
    ``decode_page_size`` 0: the prefill's."""
    dps = decode_page_size or page_size
    model = RefModel.load()
    if layers:
        model.keep_layers(layers)
    ids = [1 + (i * 7919) % (model.vocab_size - 1) for i in range(tokens)]
    pages, d_pages = -(-tokens // page_size), -(-tokens // dps)
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-layers-"))
    slow = {"waiting_timeout": 3600.0, "transfer_timeout": 3600.0, "log_level": "WARNING"}
    prefill = start_daemon("prefill", work, serve_bootstrap=True, **slow)
    decode = start_daemon("decode", work, **slow)
    p_pool = PagedKVPool(model, pages + 1, page_size, 4, seed=1)
    d_pool = PagedKVPool(model, d_pages + 1, dps, 4, seed=100)
    p_client, d_client = KvdClient(prefill.socket, timeout=600), KvdClient(decode.socket,
                                                                            timeout=600)
    runs: dict[str, list[dict[str, float]]] = {"whole": [], "layers": []}
    try:
        p_client.call(p_pool.registration)
        d_client.call(d_pool.registration)
        engine = PrefillEngine(model, [(p_pool, p_client)])
        room = 70_000
        _one(engine, d_pool, d_client, prefill.http_addr, room, ids[:64], False)  # warm
        for k in range(repeats):
            for mode in (("whole", "layers") if k % 2 == 0 else ("layers", "whole")):
                room += 1
                runs[mode].append(_one(engine, d_pool, d_client, prefill.http_addr, room, ids,
                                       mode == "layers"))
    finally:
        p_client.close()
        d_client.close()
        p_pool.shm.close()
        d_pool.shm.close()
        prefill.stop()
        decode.stop()
    row = _row(runs, tokens, model.num_layers, p_pool.item_len * 2 * model.num_layers * pages)
    return {"page_size": page_size, "decode_page_size": dps, **row}


def _one(engine: PrefillEngine, d_pool: PagedKVPool, d_client: KvdClient, boot: str,
         room: int, ids: list[int], stream: bool) -> dict[str, float]:
    """One room: the decode waits with its pages, the prefill runs; times in s."""
    dst, slot = d_pool.alloc(-(-len(ids) // d_pool.page_size)), min(d_pool.free_aux)
    receiver = Receiver(d_client, room, boot)
    receiver.init(dst, slot)
    started = time.perf_counter()
    # whole: one chunk of every prefill page
    out = engine.prefill(room, ids, chunk_pages=len(ids), stream_layers=stream)
    state = receiver.wait(600.0)
    ttft = time.perf_counter() - started
    if state != KVPoll.Success or out["state"] != int(KVPoll.Success):
        raise AssertionError(f"room {room} failed: {out.get('reason')} "
                             f"{receiver.failure_reason()}")
    if int(d_pool.aux[slot][0]) != room:  # aux (room, first token) came with the last write
        raise AssertionError(f"room {room}: the decode's aux slot is not the room's")
    receiver.clear()
    d_pool.release(dst, slot)
    return {"ttft_s": ttft, "compute_s": float(out["compute_s"]),
            "exposed_s": ttft - float(out["compute_s"]), "xfer_s": float(out["xfer_s"])}


def _row(runs: dict[str, list[dict[str, float]]], tokens: int, layers: int,
         nbytes: int) -> dict[str, Any]:
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for m, rs in runs.items()}
    # per repeat (the two modes ran back to back, under the same load), then the median:
    # on a shared machine the forward pass alone varies several-fold between repeats
    pairs = list(zip(runs["whole"], runs["layers"], strict=True))
    hidden = statistics.median(1.0 - b["exposed_s"] / a["exposed_s"] for a, b in pairs)
    ratio = statistics.median(b["ttft_s"] / a["ttft_s"] for a, b in pairs)
    return {"tokens": tokens, "layers": layers, "kv_bytes": nbytes, "median": med,
            "ttft_ratio_layers_over_whole": ratio, "hidden_fraction": hidden,
            "goal_hidden": GOAL_HIDDEN, "met": hidden >= GOAL_HIDDEN, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=PAGE_SIZE, help="prefill tokens per page")
    ap.add_argument("--decode-page-size", type=int, default=0,
                    help="decode tokens per page (0: the prefill's)")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.tokens, args.layers, args.repeats, args.page_size,
                         args.decode_page_size), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
